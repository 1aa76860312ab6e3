"""The Celery worker: claims jobs, runs them on its one engine, records results (tokenloom.store)."""
