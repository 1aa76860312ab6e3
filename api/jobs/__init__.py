"""The /v1/jobs endpoint: its routes and schemas."""
