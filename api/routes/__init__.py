"""The routes every endpoint shares: models, health, metrics. Each endpoint's own routes live in its
folder (api/openai/, api/jobs/, api/batches/, api/files/)."""
