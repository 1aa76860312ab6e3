"""Everything the routes share, built once by `create_app`: config, database, queue, model, keys."""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis
from celery import Celery
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.api.served_model import ServedModel
from tokenloom.settings.config import TokenloomConfig


@dataclass(slots=True)
class ApiState:
    config: TokenloomConfig
    sessions: sessionmaker[Session]
    celery: Celery  # sends job messages (store/celery_app.py)
    redis: aioredis.Redis  # reads job streams
    served: ServedModel
    admin_key: str | None  # the value of the env var named by [server] api_key_env
