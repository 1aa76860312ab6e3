"""`tokenloom serve` (the HTTP API under uvicorn) and `tokenloom keys create | list | grant | revoke`."""

from __future__ import annotations

import argparse
import json
import os
import sys

from tokenloom.cli.config_args import add_config_argument, add_engine_arguments, load_cli_config

EPILOG = """\
examples:
  tokenloom serve --config config.toml             # the API on [server] host:port
  tokenloom serve --model Qwen/Qwen3-0.6B --port 8000   # jobs go to that model's queue
  tokenloom keys create --project inference-lab    # prints the new key ONCE; only its hash is stored
  tokenloom keys create --project ops --allow-priority-tier --min-priority -100
                                                    # may make /v1/jobs work interactive, and preempt
  tokenloom keys list                               # prefixes, projects, allowances, revoked or not
  tokenloom keys grant tlk-AbCdEfGh --allow-priority-tier   # change an existing key's allowance
  tokenloom keys revoke tlk-AbCdEfGh                # by prefix or id: the key gets 403 from now on"""

ALLOWANCE_HELP = "classes of work (docs/priority.md)"


def add_commands(commands) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the HTTP API (jobs + OpenAI-compatible completions)",
        epilog=EPILOG,
        description="Serve the REST API with uvicorn. Jobs go to [database] url and the model's queue on "
        "[queue] broker_url; start `tokenloom worker` to run them. The admin key is read from the env var "
        "named by [server] api_key_env.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_engine_arguments(serve)
    serve.add_argument("--host", help="interface to bind (default: [server] host)")
    serve.add_argument("--port", type=int, help="TCP port (default: [server] port)")
    serve.set_defaults(handler=cmd_serve)

    keys = commands.add_parser(
        "keys",
        help="API keys per project: create | list | grant | revoke",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = keys.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    create = actions.add_parser("create", help="create a key for a project and print it once")
    create.add_argument("--project", required=True, help="the project whose jobs this key sees")
    create.add_argument("--name", default="", help="a label for listings (default: the project)")
    create.add_argument(
        "--admin", action="store_true", help="the key sees every project's jobs and may use every class of work"
    )
    create.add_argument(
        "--allow-priority-tier",
        action="store_true",
        help='service_tier "priority" may put its /v1/jobs work in the interactive class (default: refused)',
    )
    create.add_argument(
        "--min-priority",
        type=_min_priority,
        default=0,
        metavar="N",
        help="the most important priority it may set, in [-1000, 0] (default 0: it cannot preempt other projects)",
    )
    create.set_defaults(handler=cmd_keys_create)
    listing = actions.add_parser("list", help="list keys (prefix, project, name, allowance, revoked)")
    listing.add_argument("--json", action="store_true", help="one JSON object per line")
    listing.set_defaults(handler=cmd_keys_list)
    grant = actions.add_parser("grant", help=f"change a key's allowance of {ALLOWANCE_HELP}, by id or prefix")
    grant.add_argument("key", metavar="ID_OR_PREFIX")
    grant.add_argument(
        "--allow-priority-tier",
        action=argparse.BooleanOptionalAction,
        default=None,
        help='service_tier "priority" may put its /v1/jobs work in the interactive class (--no-...: refused again)',
    )
    grant.add_argument(
        "--min-priority",
        type=_min_priority,
        metavar="N",
        help="the most important priority it may set, in [-1000, 0] (0: it cannot preempt other projects)",
    )
    grant.set_defaults(handler=cmd_keys_grant)
    revoke = actions.add_parser("revoke", help="revoke a key by id or prefix (requests with it get 403)")
    revoke.add_argument("key", metavar="ID_OR_PREFIX")
    revoke.set_defaults(handler=cmd_keys_revoke)
    for action in (create, listing, grant, revoke):
        add_config_argument(action)


def _min_priority(text: str) -> int:
    from tokenloom.store.api_keys.key_queries import check_min_priority

    try:
        return check_min_priority(int(text))
    except ValueError as exc:
        message = str(exc) if text.lstrip("-").isdigit() else f"not an integer: {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def _config(args):
    return load_cli_config(args)


def _sessions(config):
    from tokenloom.store.database import make_session_factory, make_sql_engine

    return make_session_factory(make_sql_engine(config.database.url))


def cmd_serve(args) -> int:
    import uvicorn

    from tokenloom.api.app import create_app

    config = _config(args)
    _check_database(config.database.url)
    server = config.server
    app = create_app(config, admin_key=os.environ.get(server.api_key_env))
    # JSON logs: uvicorn's loggers propagate to the root handler of cli/log_setup.py, not its own.
    logging = {"log_config": None} if args.log_format == "json" else {}
    uvicorn.run(app, host=args.host or server.host, port=args.port or server.port, log_level=args.log_level, **logging)
    return 0


def _check_database(url: str) -> None:
    """Before uvicorn starts: an unreachable or never-migrated database is one line and exit 2
    here, not a traceback from the app's start-up."""
    import logging

    from tokenloom.cli.error_handler import CliError
    from tokenloom.store import migrate

    alembic = logging.getLogger("alembic")
    level = alembic.level
    alembic.setLevel(logging.WARNING)  # its INFO lines describe a migration; this only reads the revision
    try:
        revision = migrate.current(url)  # raises, saying what to check, when it cannot connect
    finally:
        alembic.setLevel(level)
    if revision is None:
        raise CliError("the database at [database] url has no tokenloom tables: run `tokenloom db upgrade` first")
    head = migrate.head()
    if revision != head:
        # Serving an older schema would answer 500 on the first query of a missing column.
        raise CliError(
            f"the database at [database] url is at schema revision {revision}, this tokenloom needs {head}: "
            "run `tokenloom db upgrade` first (or run the tokenloom version that migrated it)"
        )


def cmd_keys_create(args) -> int:
    from tokenloom.store.api_keys.key_queries import create_key

    key, info = create_key(
        _sessions(_config(args)),
        args.project,
        args.name,
        is_admin=args.admin,
        allow_priority_tier=args.allow_priority_tier,
        min_priority=args.min_priority,
    )
    print(
        f"created key {info.key_prefix}... (id {info.id}) for project {info.project!r}"
        f"{' with admin rights' if info.is_admin else ''} ({_allowance(info)}); it is shown only now, store it safely:",
        file=sys.stderr,
    )
    print(key)
    return 0


def cmd_keys_list(args) -> int:
    from tokenloom.store.api_keys.key_queries import list_keys

    keys = list_keys(_sessions(_config(args)))
    for info in keys:
        row = {
            "id": str(info.id),
            "prefix": info.key_prefix,
            "project": info.project,
            "name": info.name,
            "admin": info.is_admin,
            "allow_priority_tier": info.allow_priority_tier,
            "min_priority": info.min_priority,
            "created_at": info.created_at.isoformat(),
            "revoked_at": info.revoked_at.isoformat() if info.revoked_at else None,
        }
        if args.json:
            print(json.dumps(row))
        else:
            state = f"revoked {row['revoked_at'][:19]}" if info.revoked_at else "active"
            print(
                f"{info.key_prefix}...  {info.project:<20} {info.name:<20} {'admin ' if info.is_admin else ''}"
                f"{state}  {_allowance(info)}  {info.id}"
            )
    if not keys and not args.json:
        print("no keys: the API is open unless the admin key's env var is set", file=sys.stderr)
    return 0


def _allowance(info) -> str:
    """A key's allowance of classes of work, as listings show it."""
    if info.is_admin:
        return "every class and priority"
    tier = "priority tier" if info.allow_priority_tier else "no priority tier"
    return f"{tier}, priority >= {info.min_priority}"


def cmd_keys_grant(args) -> int:
    from tokenloom.cli.error_handler import CliError
    from tokenloom.store.api_keys.key_queries import grant_key

    if args.allow_priority_tier is None and args.min_priority is None:
        raise CliError("nothing to grant: give --allow-priority-tier, --no-allow-priority-tier and/or --min-priority N")
    try:
        info = grant_key(
            _sessions(_config(args)),
            args.key,
            allow_priority_tier=args.allow_priority_tier,
            min_priority=args.min_priority,
        )
    except LookupError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 1
    print(f"key {info.key_prefix}... of project {info.project!r} now has: {_allowance(info)}", file=sys.stderr)
    return 0


def cmd_keys_revoke(args) -> int:
    from tokenloom.store.api_keys.key_queries import revoke_key

    try:
        info = revoke_key(_sessions(_config(args)), args.key)
    except LookupError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 1
    print(f"revoked key {info.key_prefix}... of project {info.project!r}", file=sys.stderr)
    return 0
