"""The metrics endpoint: GET /metrics (Prometheus) and GET /v1/stats (routes.py), the exposition built
on each scrape (prometheus_exposition.py), the /v1/stats schemas (stats_schemas.py) and the
inter-token latency of relayed streams (stream_itl.py, recorded by api/openai/stream_relay.py)."""
