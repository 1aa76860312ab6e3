"""Alembic migrations of the tokenloom schema (tokenloom.store.migrate runs them; env.py is Alembic's entry)."""
