"""The CLI's one error handler: what escapes a command becomes one `error: ...` line and an exit code.

Exit 2 for what the user can fix: configuration, an unreachable service (database, Redis), bad
input (a missing or unreadable file, a malformed id). Anything else is a bug or an outage of an
unknown kind: exit 1, still one line. `tokenloom --debug COMMAND` shows the traceback instead.
"""

from __future__ import annotations

import sys

USAGE_ERROR = 2
UNEXPECTED_ERROR = 1

# Top-level modules of the optional extras (pyproject.toml) -> the extra that installs them.
EXTRA_OF_MODULE = {
    "celery": "queue",
    "kombu": "queue",
    "redis": "queue",
    "psycopg": "queue",
    "tenacity": "queue",
    "fastapi": "api",
    "starlette": "api",
    "uvicorn": "api",
    "multipart": "api",
    "prometheus_client": "api",
    "bitsandbytes": "quant",
    "matplotlib": "sweep",
}


class CliError(Exception):
    """An error a command raises on purpose: its message is the whole line the user sees."""

    def __init__(self, message: str, exit_code: int = USAGE_ERROR):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


def report(err: BaseException, command: str) -> int:
    """Print one line for `err` on stderr; return the exit code."""
    message, code = describe(err, command)
    print(f"error: {' '.join(message.split())}", file=sys.stderr)  # one line, whatever the message holds
    return code


def describe(err: BaseException, command: str) -> tuple[str, int]:
    if isinstance(err, CliError):
        return err.message, err.exit_code
    if isinstance(err, ModuleNotFoundError) and (extra := EXTRA_OF_MODULE.get((err.name or "").split(".")[0])):
        return (
            f"`tokenloom {command}` needs the optional package {err.name}: "
            f"pip install 'tokenloom[{extra}]' (or 'tokenloom[all]')",
            USAGE_ERROR,
        )
    from tokenloom.settings.config import ConfigError

    if isinstance(err, ConfigError) or _is_loaded(err, MODEL_ERRORS):
        return str(err), USAGE_ERROR
    service = _unreachable_service(err)
    if service:
        return f"cannot reach {service}: {_first_line(err)}", USAGE_ERROR
    if _unreachable_service(err.__cause__):  # a wrapper whose message already says what to check
        return str(err), USAGE_ERROR
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.strerror or err}: {err.filename}", USAGE_ERROR
    return (
        f"unexpected {type(err).__name__}: {_first_line(err)} "
        f"(rerun as `tokenloom --debug {command} ...` for the traceback)",
        UNEXPECTED_ERROR,
    )


# A model that cannot be loaded or does not fit: the message says which file or setting to fix.
MODEL_ERRORS = (
    ("tokenloom.engine.models.loader", "ModelLoadError"),
    ("tokenloom.engine.models.architectures", "UnsupportedModelError"),
    ("tokenloom.engine.runner.kv_plan", "KVCacheTooSmallError"),
    ("tokenloom.engine.runner.device", "DeviceUnavailableError"),
)


def _is_loaded(err: BaseException, classes: tuple[tuple[str, str], ...]) -> bool:
    """isinstance(err, any of `classes`) for the (module, class) pairs already imported: a module
    that was never imported raised nothing, and importing it here could be slow or fail."""
    return any(
        isinstance(err, getattr(sys.modules[module], name))
        for module, name in classes
        if module in sys.modules and hasattr(sys.modules[module], name)
    )


def _unreachable_service(err: BaseException | None) -> str | None:
    """Which service `err` says is unreachable (or misaddressed), or None."""
    if err is None:
        return None
    for module, names, service in (
        (
            "sqlalchemy.exc",
            ("OperationalError", "InterfaceError", "ArgumentError", "NoSuchModuleError"),
            "the database at [database] url (TOKENLOOM_DATABASE_URL)",
        ),
        (
            "redis.exceptions",
            ("ConnectionError", "TimeoutError", "AuthenticationError"),
            "Redis at [queue] broker_url (TOKENLOOM_QUEUE_BROKER_URL)",
        ),
        ("kombu.exceptions", ("OperationalError",), "Redis at [queue] broker_url (TOKENLOOM_QUEUE_BROKER_URL)"),
        (
            "tokenloom.store.jobs.job_queries",
            ("QueueUnavailableError",),
            "Redis at [queue] broker_url (TOKENLOOM_QUEUE_BROKER_URL)",
        ),
    ):
        loaded = sys.modules.get(module)  # a library that was never imported raised nothing
        if loaded and isinstance(err, tuple(getattr(loaded, name) for name in names if hasattr(loaded, name))):
            return service
    if isinstance(err, ConnectionError):
        return "a service"
    return None


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
