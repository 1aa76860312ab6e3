"""The device check: every GPU claim of tokenloom measured in one run, results as JSON.

    python3 -m bench.gpu_check --out DIR                 # on a CUDA machine (bench/gpu_check.sh)
    python3 -m bench.gpu_check --out DIR --device cpu --smoke   # the harness on a CPU, tiny shapes

Sections, each under its own time budget and guarded, so one that fails or overruns is recorded
as such and the rest still run; the JSON is rewritten after every section, so a run cut short
keeps what finished:
  kernels  Triton vs the torch reference at Qwen2.5-0.5B, Qwen3-0.6B and Llama-3-8B head layouts,
           fp16 / bf16 / fp32 (bench/gpu_kernels.py)
  oracle   greedy tokens equal transformers' in fp32 for llama, mistral, qwen2, qwen3 under chunked
           prefill, preemption (recompute and swap) and prefix hits (bench/gpu_oracle.py)
  oracle_newer  the same for Qwen3-MoE, Mixtral (routed experts through grouped_mm), Gemma 3 and
           partial-RoPE Phi-3, under chunked prefill and swap
  decode   decode step time with CUDA graphs on and off vs transformers, against the bandwidth
           limit (bench/gpu_decode.py)
  w2       W2 offline throughput vs transformers generate and generate_batch, graphs on and off
           (bench/gpu_w2.py)
"""

from __future__ import annotations

import argparse
import json
import platform
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


class SectionTimeout(Exception):
    """A section used up its budget."""


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    budget_s: int  # on a GPU; the sections add up to well under the script's 9 minutes
    run: Callable[[dict, argparse.Namespace], None]  # fills the dict it is given as it goes


def _kernels(result: dict, args) -> None:
    from bench import gpu_kernels

    result.update(gpu_kernels.run(smoke=args.smoke))


def _oracle(result: dict, args) -> None:
    from bench import gpu_oracle

    with tempfile.TemporaryDirectory() as root:
        # The smoke run checks the wiring: the torch reference spares it triton's slow CPU interpreter.
        backend = "torch" if args.smoke else "triton"
        result.update(gpu_oracle.run(Path(root), args.device, backend, smoke=args.smoke))


def _oracle_newer(result: dict, args) -> None:
    from bench import gpu_oracle

    with tempfile.TemporaryDirectory() as root:
        backend = "torch" if args.smoke else "triton"
        result.update(gpu_oracle.run(Path(root), args.device, backend, smoke=args.smoke, newer=True))


def _decode(result: dict, args) -> None:
    from bench import gpu_decode

    argv = ["--device", args.device, "--backends", "triton", "triton-eager"]
    if args.smoke:
        argv += ["--shape", "tiny", "--dtype", "float32", "--batch-sizes", "1", "3", "--prompt-len", "8",
                 "--decode-tokens", "4"]
    else:
        argv += ["--batch-sizes", "1", "8", "64", "128", "--decode-tokens", "48"]
    result.update(gpu_decode.run(gpu_decode.parse(argv)))


def _w2(result: dict, args) -> None:
    from bench import gpu_w2

    gpu_w2.run(result, args.device, smoke=args.smoke)


SECTIONS = (
    Section("kernels", 45, _kernels),
    Section("oracle", 100, _oracle),
    Section("oracle_newer", 75, _oracle_newer),
    Section("decode", 90, _decode),
    Section("w2", 210, _w2),
)


def run_section(section: Section, args) -> dict:
    """{status: ok | failed | timed_out, seconds, ...what the section recorded, error}."""
    result: dict = {}

    def overrun(signum, frame):
        raise SectionTimeout(f"section {section.name} exceeded its {section.budget_s} s budget")

    previous = signal.signal(signal.SIGALRM, overrun)
    signal.alarm(section.budget_s * (20 if args.smoke else 1))  # the CPU interpreter is slow
    start = time.perf_counter()
    try:
        section.run(result, args)
        status = "ok"
    except SectionTimeout as err:
        status, result["error"] = "timed_out", str(err)
    except Exception as err:  # recorded, and the next section runs
        status, result["error"] = "failed", f"{type(err).__name__}: {err}\n{traceback.format_exc()[-3000:]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    return {"status": status, "seconds": round(time.perf_counter() - start, 1), **result}


def environment(device: str) -> dict:
    import transformers
    import triton

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "device": device}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for gpu_check.json")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes: the harness on a CPU")
    parser.add_argument("--sections", nargs="+", choices=[s.name for s in SECTIONS], default=[s.name for s in SECTIONS])
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this script is for a GPU machine")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "gpu_check.json"
    report = {"environment": environment(args.device), "sections": {}}
    for section in SECTIONS:
        if section.name not in args.sections:
            continue
        print(f"== {section.name} (budget {section.budget_s} s) ==", flush=True)
        report["sections"][section.name] = outcome = run_section(section, args)
        print(f"== {section.name}: {outcome['status']} in {outcome['seconds']} s ==", flush=True)
        path.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {path}")
    return 0 if all(s["status"] == "ok" for s in report["sections"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
