"""The /v1/files endpoint: its routes and schemas."""
