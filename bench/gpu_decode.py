"""Decode step time on a GPU: tokenloom (Triton with CUDA graphs, Triton eager, torch) vs transformers,
against the bandwidth limit. One section of bench/gpu_check.py; also runs alone:

    python -m bench.gpu_decode                       # 0.5B shape, bf16, CUDA, batch sizes 1 8 32 64 128
    python -m bench.gpu_decode --shape tiny --device cpu --backends torch --batch-sizes 1 4   # CPU smoke run

Model: a seeded random Llama with Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 KV
heads: a GQA group of 7, head_dim 64, vocab 151936), built on first use in ~/.cache/tokenloom.
Every batch runs `prompt_len`-token random prompts with `ignore_eos`. Decode step time is the
median of the engine steps that held only decodes (after warm-up); transformers' step time is
the median of generate's own decode steps on the same prompts, batch and dtype, each timed from
one call of a logits processor to the next (the processor synchronises the device, so each
interval is one whole decode step: forward, token pick, bookkeeping), never a difference of two
separate runs. The roofline column is the bytes a decode step must read (see `DecodeReads`: the
layers' weights and the LM head once, one embedding row per sequence, the KV at the run's mean
context) / measured device copy bandwidth: no decode step can beat it. "triton" runs with CUDA
graphs (on a GPU), "triton-eager" the same kernels with [model] enforce_eager = true.
Each system's engine is built once and serves every batch size (each batch on prompts of its own,
so no batch hits another's prefix cache); rows reach `progress` (the check's saved record) as each
system finishes a batch size.
Also printed: how many greedy tokens the graphs share with the same kernels run eagerly, batch by
batch (the batch sizes are graph buckets and every sequence decodes to the end, so each replay
runs the same kernels on the same shapes as the eager step: anything but 100% is a graph fault),
and with the torch backend when it runs (in bf16 rounding may let those part after a while; the
fp32 equality is a test, not this).
Not a test: speed is only compared within one run of this script on one machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, LogitsProcessor, LogitsProcessorList

from tokenloom.engine.config import EngineConfig
from tokenloom.engine.loop.engine import Engine
from tokenloom.engine.models.decoder import DecoderModel
from tokenloom.engine.models.demo.random_checkpoint import build_tokenizer
from tokenloom.engine.runner.model_setup import default_cache_dir, model_weight_bytes
from tokenloom.engine.sample.sampling_params import SamplingParams
from tokenloom.settings.config import load_config

SHAPES = {
    # Qwen2.5-0.5B's shape as a Llama (no qkv bias): the 0.5B model BENCHMARKS.md asks for on a GPU.
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    ),
    # For a smoke run of this script on a CPU.
    "tiny": dict(
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=384,
        max_position_embeddings=1024,
    ),
}


def checkpoint(shape: str, dtype: torch.dtype, device: str) -> Path:
    """The seeded random checkpoint of `shape`, built once. Built in a private folder and renamed into
    place whole: a build cut short (a section's budget, a kill) leaves no folder that looks complete."""
    path = default_cache_dir() / f"bench-{shape}-{str(dtype).removeprefix('torch.')}"
    if (path / "config.json").is_file():
        return path
    staging = path.with_name(f"{path.name}.building-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    torch.manual_seed(0)
    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2, initializer_range=0.02)
    with torch.device(device):  # random init of 0.5B parameters is much faster on the GPU
        model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(staging)
    del model
    free_device_memory(device)
    build_tokenizer().save_pretrained(staging)  # unused: prompts are token ids
    shutil.rmtree(path, ignore_errors=True)  # a folder an older, non-atomic build left incomplete
    try:
        staging.rename(path)
    except OSError:  # another process renamed its build into place first: use that one
        shutil.rmtree(staging, ignore_errors=True)
    return path


def prompts(batch: int, prompt_len: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab_size, 32000), (batch, prompt_len), generator=generator).tolist()


def engine_config(path: Path, args, system: str) -> EngineConfig:
    """One engine per system that serves every batch size of the run: the largest batch prefills in one step."""
    blocks_per_seq = -(-(args.prompt_len + args.decode_tokens + 8) // 16)
    largest = max(args.batch_sizes)
    return (
        load_config(None, env={})
        .replace(
            "model",
            name=str(path),
            dtype=args.dtype,
            device=args.device,
            attention_backend=system.removesuffix("-eager"),
            max_model_len=args.prompt_len + args.decode_tokens + 8,
            enforce_eager=system.endswith("-eager"),
        )
        .replace(
            "kv_cache",
            num_blocks=blocks_per_seq * largest + 16,
            swap_space_gb=0,
        )
        .replace(
            "scheduler",
            max_num_seqs=largest,
            max_num_batched_tokens=largest * args.prompt_len,
        )
    )


def decode_engine(path: Path, args, system: str) -> Engine:
    """The system's engine, its kernels compiled (decode and prefill) before any batch is timed."""
    engine = Engine(engine_config(path, args, system))
    backend = system.removesuffix("-eager")
    assert engine.backend.name == backend, f"asked for {backend}, engine runs {engine.backend.name}"
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.generate(prompts(2, args.prompt_len, engine.loaded.shape.vocab_size, seed=0), warm)  # batches: seed = size
    return engine


def engine_decode(engine: Engine, args, batch: int) -> dict:
    """Median decode-only step time of one batch on `engine`, plus the greedy tokens it produced."""
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts(batch, args.prompt_len, engine.loaded.shape.vocab_size, seed=batch)):
        engine.add_request(f"b{batch}-r{i}", prompt, params=params)
    step_seconds, outputs = [], {}
    start = time.perf_counter()
    while engine.has_unfinished_requests:
        prefill_before = engine.counters.num_prefill_tokens
        step_start = time.perf_counter()
        for output in engine.step():  # sampling reads the tokens back: the step has finished on the device
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
        if engine.counters.num_prefill_tokens == prefill_before:
            step_seconds.append(time.perf_counter() - step_start)
    wall = time.perf_counter() - start
    return {
        "step_ms": 1000 * statistics.median(step_seconds[3:] or step_seconds),
        "e2e_tok_s": batch * args.decode_tokens / wall,
        "tokens": [outputs[f"b{batch}-r{i}"] for i in range(batch)],
        "weight_bytes": engine.loaded.weight_bytes,
        "reads": decode_reads(engine.loaded.model, engine.kv_plan.bytes_per_token),
        "graphs": engine.runner.graphs is not None,
        "graphs_plan": engine.graph_plan.describe(),
    }


def hf_decode(model, args, batch: int) -> dict:
    """Median decode step time of transformers' generate, each step measured, plus its end-to-end rate."""
    ids = torch.tensor(prompts(batch, args.prompt_len, model.config.vocab_size, seed=batch), device=args.device)
    hf_generate(model, ids, 4, args.device)  # warm-up
    step_seconds, wall = hf_generate(model, ids, args.decode_tokens, args.device)
    return {
        "step_ms": 1000 * statistics.median(step_seconds[3:] or step_seconds),
        "e2e_tok_s": batch * args.decode_tokens / wall,
    }


class StepClock(LogitsProcessor):
    """Stamps the time each time generate asks for the next token's scores.

    generate calls its logits processors once per new token, right after that step's forward pass,
    so the interval between two calls is exactly one decode step. The device is synchronised
    before each stamp, so a step's queued kernels count in the step that launched them.
    """

    def __init__(self, device: str):
        self.device = device
        self.stamps: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        sync_device(self.device)
        self.stamps.append(time.perf_counter())
        return scores

    def step_seconds(self) -> list[float]:
        """One entry per decode step (the first stamp closes the prefill, which is not a decode step)."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


@torch.inference_mode()
def hf_generate(model, ids: torch.Tensor, new_tokens: int, device: str) -> tuple[list[float], float]:
    """(each decode step's seconds, the whole call's seconds) of one greedy generate of `new_tokens`."""
    clock = StepClock(device)
    sync_device(device)
    start = time.perf_counter()
    model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([clock]),
    )
    sync_device(device)
    wall = time.perf_counter() - start
    steps = clock.step_seconds()
    assert len(steps) == new_tokens - 1, f"generate made {len(steps) + 1} scoring calls for {new_tokens} tokens"
    return steps, wall


def copy_bandwidth(device: str) -> float | None:
    """Bytes/s of a large device-to-device copy (read + write), the bound on a decode step."""
    if device != "cuda":
        return None
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync_device(device)
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync_device(device)
    seconds = (time.perf_counter() - start) / 10
    del src, dst
    free_device_memory(device)
    return 2 * (1 << 30) / seconds


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def sync_device(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_device_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument(
        "--backends",
        nargs="+",
        default=["triton", "triton-eager", "torch"],
        choices=["triton", "triton-eager", "torch"],
    )
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers generate peer")
    parser.add_argument("--json", type=Path, default=Path("bench/results/gpu_decode.json"))
    return parser


def main(argv=None) -> None:
    args = parse(argv)
    result = run(args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


def parse(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be at least 2: a decode step follows the first token")
    return args


def run(args, progress: dict | None = None) -> dict:
    """The decode table (printed) and its rows (returned, JSON-ready). `progress` gets the rows
    measured so far after each system's batch (a RecordedResult saves them, so a cut-short run keeps them)."""
    path = checkpoint(args.shape, getattr(torch, args.dtype), args.device)
    bandwidth = copy_bandwidth(args.device)
    rows = [{"batch": batch} for batch in args.batch_sizes]
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    reads: DecodeReads | None = None
    weight_bytes = 0
    for system in args.backends:
        engine = decode_engine(path, args, system)
        for row in rows:
            measured = engine_decode(engine, args, row["batch"])
            tokens[system, row["batch"]] = measured.pop("tokens")
            reads, weight_bytes = measured.pop("reads"), measured.pop("weight_bytes")
            row[system] = measured
            _save(progress, rows, args, reads, bandwidth)
            print(f"batch {row['batch']}: {system} {measured['step_ms']:.2f} ms", flush=True)
        del engine
        free_device_memory(args.device)
    if not args.no_hf:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device).eval()
        for row in rows:
            row["hf"] = hf_decode(model, args, row["batch"])
            _save(progress, rows, args, reads, bandwidth)
            print(f"batch {row['batch']}: transformers {row['hf']['step_ms']:.2f} ms", flush=True)
        del model
        free_device_memory(args.device)
    for row in rows:
        row.update(token_agreement(tokens, row["batch"], args))
    assert reads is not None  # at least one system ran
    report(args, rows, weight_bytes, reads, bandwidth)
    return _save(progress, rows, args, reads, bandwidth)


def token_agreement(tokens: dict[tuple[str, int], list[list[int]]], batch: int, args) -> dict:
    """Share of greedy tokens the graphs keep with the same kernels run eagerly (and with the torch
    backend, when it ran) before the two first differ, over the batch."""
    pairs = {"graph_tokens_equal_eager": ("triton", "triton-eager"), "triton_tokens_equal_torch": ("triton", "torch")}
    agreement = {}
    for name, (a, b) in pairs.items():
        if (a, batch) in tokens and (b, batch) in tokens:
            same = [shared_prefix(x, y) for x, y in zip(tokens[a, batch], tokens[b, batch])]
            agreement[name] = sum(same) / (batch * args.decode_tokens)
    return agreement


def _save(progress: dict | None, rows: list[dict], args, reads: DecodeReads | None, bandwidth: float | None) -> dict:
    """The section's JSON as it stands, with each row's bandwidth limit; set on `progress` when given."""
    saved_rows = []
    for row in rows:
        row = dict(row)
        if bandwidth and reads is not None:
            row["limit_step_ms"] = 1000 * reads.step_bytes(row["batch"], mean_context(args)) / bandwidth
            if "triton" in row:
                row["triton_vs_limit"] = row["triton"]["step_ms"] / row["limit_step_ms"]
        saved_rows.append(row)
    result = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "copy_bandwidth_gb_s": bandwidth and bandwidth / 1e9,
        "reads": reads and asdict(reads),
        "rows": saved_rows,
    }
    if progress is not None:
        progress.update(result)
    return result


@dataclass(frozen=True, slots=True)
class DecodeReads:
    """What one decode step must read from device memory: the floor under its time at a given bandwidth."""

    weight_bytes: int  # every decoder layer's weights and the LM head, the LM head once even when tied
    embedding_row_bytes: int  # one token's embedding: a decode step gathers one row per sequence, not the table
    kv_bytes_per_token: int  # K and V of every layer for one context token

    def step_bytes(self, batch: int, context_len: int) -> int:
        """A step of `batch` sequences, each attending over `context_len` cached tokens."""
        return self.weight_bytes + batch * (self.embedding_row_bytes + context_len * self.kv_bytes_per_token)


def decode_reads(model: DecoderModel, kv_bytes_per_token: int) -> DecodeReads:
    """The model's weights less its embedding table, unless that table is also the LM head (tied
    embeddings on the device: one tensor, read in full by the LM head's GEMM)."""
    table = model.embed_tokens.weight  # [vocab_size, hidden_size]
    head = getattr(model.lm_head, "weight", None)  # a packed CPU LM head holds no `weight`: its own copy
    tied = head is not None and head.data_ptr() == table.data_ptr()
    table_bytes = table.numel() * table.element_size()
    return DecodeReads(
        weight_bytes=model_weight_bytes(model) - (0 if tied else table_bytes),
        embedding_row_bytes=table_bytes // table.shape[0],
        kv_bytes_per_token=kv_bytes_per_token,
    )


def mean_context(args) -> int:
    """Cached tokens a sequence attends over at the run's middle decode step."""
    return args.prompt_len + args.decode_tokens // 2


def report(args, rows: list[dict], weight_bytes: int, reads: DecodeReads, bandwidth: float | None) -> None:
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(
        f"\n{args.shape} random Llama, {args.dtype}, {device}; prompts {args.prompt_len} tokens, "
        f"{args.decode_tokens} decode steps; weights {weight_bytes / 2**20:,.0f} MiB, "
        f"{reads.weight_bytes / 2**20:,.0f} MiB of them read by a decode step"
    )
    systems = args.backends + ([] if args.no_hf else ["hf"])
    names = {
        "triton": "tokenloom triton",
        "triton-eager": "tokenloom triton eager",
        "torch": "tokenloom torch",
        "hf": "transformers generate",
    }
    header = ["batch"] + [f"{names[s]} step ms" for s in systems] + [f"{names[s]} tok/s" for s in systems]
    others = [s for s in systems if s != "triton"] if "triton" in systems else []
    token_columns = {
        "graph_tokens_equal_eager": "graphs = eager tokens",
        "triton_tokens_equal_torch": "triton = torch tokens",
    }
    token_columns = {key: name for key, name in token_columns.items() if key in rows[0]}
    header += [f"triton vs {s}" for s in others] + list(token_columns.values())
    if bandwidth:
        header += ["limit step ms", "triton / limit"]
    print("| " + " | ".join(header) + " |")
    print("|" + " ---: |" * len(header))
    for row in rows:
        batch = row["batch"]
        cells = [str(batch)]
        cells += [f"{row[s]['step_ms']:.2f}" for s in systems]
        cells += [f"{1000 * batch / row[s]['step_ms']:,.0f}" for s in systems]
        cells += [f"{row[s]['step_ms'] / row['triton']['step_ms']:.2f}x" for s in others]
        cells += [f"{row[key]:.0%}" for key in token_columns]
        if bandwidth:
            limit_ms = 1000 * reads.step_bytes(batch, mean_context(args)) / bandwidth
            cells += [f"{limit_ms:.2f}", f"{row['triton']['step_ms'] / limit_ms:.2f}x" if "triton" in row else "-"]
        print("| " + " | ".join(cells) + " |")
    print("tok/s = batch / decode step time (decode only); 'triton vs X' = X step time / triton step time.")
    print(
        "'graphs = eager tokens', 'triton = torch tokens': share of greedy tokens before the two outputs first differ."
    )


if __name__ == "__main__":
    main()
