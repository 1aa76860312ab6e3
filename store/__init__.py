"""The shared store: what the API and the workers both read and write.

SQLAlchemy models and sessions, the queries and state transitions of jobs, batches and files,
the API-key rows, batch finalization, the offline run ledger, the Celery hand-off both sides share (queue names,
sending a job's message) and the Redis stream keys. Migrations are tokenloom.migrations.
"""
