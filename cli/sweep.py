"""`tokenloom sweep` and `tokenloom bench quant`: operating-point measurements from the CLI."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tokenloom.cli.config_args import add_engine_arguments, load_cli_config

SWEEP_HELP = """\
Run the same request set at each VALUE of one config KEY and measure peak memory, TTFT, TPOT and
throughput; writes <prefix>.csv and <prefix>.png and names the best operating point (highest
throughput, ties to lower memory). Every request arrives at once and generates exactly
--output-tokens tokens (EOS ignored), so values compare like for like."""

SWEEP_EPILOG = """\
examples:
  tokenloom sweep kv_cache.gpu_memory_utilization 0.60:0.95:0.05 --prompt-tokens 4096
  tokenloom sweep kv_cache.block_size 8,16,32
  tokenloom sweep scheduler.max_num_seqs 8:64:8 --requests 64
  tokenloom sweep quantization.method none,int8,int4

VALUES: START:STOP:STEP (inclusive) for numeric keys, or a comma-separated list. A value that
cannot run (e.g. too little KV memory) becomes a row with its error; the sweep goes on."""

BENCH_QUANT_HELP = """\
Compare full precision, int8 and int4 (bitsandbytes) on the same request set: weight memory,
TTFT, TPOT, throughput, and agreement of the greedy output with full precision."""


def add_commands(commands) -> None:
    sweep = commands.add_parser(
        "sweep",
        help="measure one config key across values (CSV + PNG chart)",
        description=SWEEP_HELP,
        epilog=SWEEP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep.add_argument("key", metavar="KEY", help="SECTION.KEY, e.g. kv_cache.block_size")
    sweep.add_argument("values", metavar="VALUES", help="START:STOP:STEP or a,b,c")
    sweep.add_argument("-o", "--output", metavar="PREFIX", help="output files prefix (default: sweep-<KEY>)")
    _request_args(sweep)
    sweep.set_defaults(handler=cmd_sweep)

    bench = commands.add_parser(
        "bench", help="built-in benchmarks: quant", description="Built-in benchmarks that run on the configured model."
    )
    kinds = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    quant = kinds.add_parser(
        "quant",
        help="none vs int8 vs int4",
        description=BENCH_QUANT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    quant.add_argument("-o", "--output", metavar="PREFIX", help="output files prefix (default: bench-quant)")
    _request_args(quant)
    quant.set_defaults(handler=cmd_bench_quant)


def _request_args(parser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--requests", type=int, default=32, help="requests in the set (default 32)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens per prompt (default 512)")
    parser.add_argument("--output-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts")


def _setup(args):
    from tokenloom.offline.operating_point import RequestSet
    from tokenloom.settings.config import ConfigError

    for name in ("requests", "prompt_tokens", "output_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    config = load_cli_config(args)
    return config, RequestSet(args.requests, args.prompt_tokens, args.output_tokens, args.seed)


def cmd_sweep(args) -> int:
    from tokenloom.cli.sweep_values import parse_values
    from tokenloom.engine.config import ConfigError

    try:
        config, requests = _setup(args)
        values = parse_values(args.key, args.values)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.key == "kv_cache.gpu_memory_utilization" and not _on_cuda(config):
        print(
            "note: on CPU the KV budget is [kv_cache] cpu_kv_space_gb, so gpu_memory_utilization changes "
            "nothing here; sweep kv_cache.cpu_kv_space_gb instead",
            file=sys.stderr,
        )
    prefix = Path(args.output or f"sweep-{args.key.replace('.', '-')}")
    return _run_and_report(config, args.key, values, requests, prefix)


def cmd_bench_quant(args) -> int:
    from tokenloom.engine.config import ConfigError

    try:
        config, requests = _setup(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return _run_and_report(
        config,
        "quantization.method",
        ["none", "int8", "int4"],
        requests,
        Path(args.output or "bench-quant"),
        agreement=True,
    )


def _run_and_report(config, key, values, requests, prefix: Path, agreement: bool = False) -> int:
    from tqdm import tqdm

    from tokenloom.offline.sweep import best, markdown_table, run_sweep, write_chart, write_csv

    with tqdm(total=len(values), unit="value", desc=key, file=sys.stderr) as bar:
        rows = run_sweep(config, key, values, requests, on_row=lambda _: bar.update(1))
    write_csv(rows, prefix.with_suffix(".csv"))
    title = (
        f"{key}: {requests.num_requests} requests x {requests.prompt_tokens} prompt + "
        f"{requests.output_tokens} output tokens"
    )
    if any(r.point is not None for r in rows):
        write_chart(rows, key, prefix.with_suffix(".png"), title)
    print(markdown_table(rows, key))
    if agreement:
        print(_agreement_table(rows))
    top = best(rows)
    if top is None:
        print("error: no value could run; see the error column", file=sys.stderr)
        return 1
    print(
        f"\nbest operating point: {key} = {top.value} ({top.point.throughput_tok_s:,.1f} output tok/s, "
        f"peak memory {top.point.peak_memory_gib:.3f} GiB); wrote {prefix.with_suffix('.csv')} and "
        f"{prefix.with_suffix('.png')}",
        file=sys.stderr,
    )
    return 0


def _agreement_table(rows) -> str:
    reference = rows[0].point
    lines = ["", "| method | identical outputs | tokens before first difference |", "| --- | ---: | ---: |"]
    for row in rows:
        if row.point is None or reference is None:
            continue
        same = matched = total = 0
        for ref, out in zip(reference.outputs, row.point.outputs):
            same += ref == out
            matched += next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
            total += len(ref)
        lines.append(f"| {row.value} | {same}/{len(reference.outputs)} | {matched / max(total, 1):.1%} |")
    return "\n".join(lines)


def _on_cuda(config) -> bool:
    import torch

    return config.model.device == "cuda" or (config.model.device == "auto" and torch.cuda.is_available())
