"""The operational routes: models (GET /v1/models) and health (probes, version). Each endpoint's own
routes live in its folder (api/openai/, api/jobs/, api/batches/, api/files/, api/metrics/)."""
