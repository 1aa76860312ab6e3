"""The /v1/batches endpoint: its routes, schemas, batch input file checks and per-line jobs."""
