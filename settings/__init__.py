"""tokenloom's whole configuration (config.toml + TOKENLOOM_* variables): see settings/config.py."""
