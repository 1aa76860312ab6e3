"""`create_app(config)`: the FastAPI application, wired once from the frozen config.

Run it with `tokenloom serve` (uvicorn). Nothing here reads the environment: the admin key's
value is passed in by the caller (the CLI reads the env var named by [server] api_key_env).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from fastapi import FastAPI

from tokenloom.api.batches import routes as batches
from tokenloom.api.body_limit import BodyLimitMiddleware
from tokenloom.api.errors import install_error_handlers
from tokenloom.api.files import routes as files
from tokenloom.api.jobs import routes as jobs
from tokenloom.api.metrics import routes as metrics
from tokenloom.api.openai import routes as openai
from tokenloom.api.openai import tokenizer
from tokenloom.api.routes import health, models
from tokenloom.api.served_model import ServedModel
from tokenloom.api.state import ApiState
from tokenloom.settings.config import TokenloomConfig
from tokenloom.store.api_keys.key_queries import any_keys
from tokenloom.store.celery_app import make_celery
from tokenloom.store.database import make_session_factory, make_sql_engine

log = logging.getLogger("tokenloom.api")

OPEN_API_WARNING = (
    "!!! the API is OPEN: no admin key (env var %s is unset) and no project keys exist, so anyone who can "
    "reach this port can submit and read every job. Set %s, or run `tokenloom keys create --project NAME`. !!!"
)


def create_app(config: TokenloomConfig, *, admin_key: str | None = None, served: ServedModel | None = None) -> FastAPI:
    """`served` defaults to loading [model]'s tokenizer (no weights); tests may pass one in."""
    served = served or ServedModel.load(config.model, config.sampling)
    served.strict_fields = config.server.strict_fields
    served.max_prompt_logprob_entries = config.server.max_prompt_logprob_entries
    state = ApiState(
        config=config,
        sessions=make_session_factory(make_sql_engine(config.database.url)),
        celery=make_celery(config.queue.broker_url),
        redis=aioredis.Redis.from_url(config.queue.broker_url),
        served=served,
        admin_key=admin_key or None,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        if not state.admin_key and not any_keys(state.sessions):
            env = config.server.api_key_env
            log.warning(OPEN_API_WARNING, env, env)
        log.info(
            "serving model %s (max_model_len %d) on queue broker %s",
            state.served.name,
            state.served.max_model_len,
            config.queue.broker_url.rsplit("@", 1)[-1],
        )
        yield
        await state.redis.aclose()

    app = FastAPI(
        title="tokenloom",
        version="0.1.0",
        lifespan=lifespan,
        description="LLM batch inference over a job queue: jobs, OpenAI-compatible completions, files and batches.",
    )
    app.state.tokenloom = state
    install_error_handlers(app)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=config.server.max_body_mb * 2**20,
        upload_paths=frozenset({"/v1/files"}),
        max_upload_bytes=config.server.max_file_mb * 2**20,
    )
    for router in (
        jobs.router,
        openai.router,
        files.router,
        batches.router,
        models.router,
        tokenizer.router,
        health.router,
        metrics.router,
    ):
        app.include_router(router)
    return app
