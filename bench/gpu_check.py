"""The device check: every GPU claim of tokenloom measured in one run, results as JSON.

    bash bench/gpu_check.sh                               # on a CUDA machine
    python3 -m bench.gpu_check --out DIR --device cpu --smoke   # the harness on a CPU, tiny shapes

Sections, each in its own process under its own time budget (`timeout`, which also ends a hung
kernel, and a CUDA error cannot poison the next section's context). A section writes its JSON
(DIR/sections/NAME.json) as its cases finish, so one that fails or overruns keeps the cases it
got through; gpu_check.json is rewritten after every section.
  smoke    first, about a minute: imports, one kernel case, one tiny oracle case; if it fails the
           run stops (the rest would fail the same way, and device time is short)
  kernels  Triton vs the torch reference at Qwen2.5-0.5B, Qwen3-0.6B and Llama-3-8B head layouts,
           fp16 / bf16 / fp32, prefill and decode-only steps (bench/gpu_kernels.py); its 24 kernel
           variants compile in parallel processes first (bench/gpu_variants.py counts every
           section's first-time compiles against its budget)
  oracle   greedy tokens equal transformers' in fp32 for llama, mistral, qwen2, qwen3 under chunked
           prefill, preemption (recompute and swap) and prefix hits (bench/gpu_oracle.py)
  oracle_newer  the same for Qwen3-MoE, Mixtral (routed experts through grouped_mm), Gemma 3 and
           partial-RoPE Phi-3, under chunked prefill and swap
  decode   decode step time with CUDA graphs on and off vs transformers, against the bandwidth
           limit, and the graphs' greedy tokens against eager ones (bench/gpu_decode.py)
  w2       W2 offline throughput vs transformers generate and generate_batch, graphs on and off
           (bench/gpu_w2.py)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


class SectionTimeout(BaseException):
    """A section used up its budget. Not an Exception: code inside a section that survives its own
    failures (the engine failing only the requests a step hit, the parallel precompile) must not
    swallow the end of the budget."""


class RecordedResult(dict):
    """A section's result that writes itself to `path` whenever a key is set, so the cases a
    section finished survive it being killed. Sections set a key per finished case or table."""

    def __init__(self, path: Path | None):
        super().__init__()
        self.path = path

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self.save()

    def update(self, *args, **kwargs) -> None:
        super().update(*args, **kwargs)
        self.save()

    def save(self) -> None:
        if self.path is not None:
            write_atomically(self.path, json.dumps(self, indent=1, default=str))


def write_atomically(path: Path, text: str) -> None:
    """A kill mid-write leaves the previous record whole, never a truncated one."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    os.replace(partial, path)


@dataclass(frozen=True, slots=True)
class Section:
    name: str
    budget_s: int  # on a GPU: 420 s in all, about 460 s with the processes' starts (the script's 8 minutes)
    run: Callable[[dict, argparse.Namespace], None]  # fills the dict it is given as it goes


def _kernels(result: dict, args) -> None:
    from bench import gpu_kernels, gpu_variants

    if args.device == "cuda" and not args.smoke:
        # Compile-bound by design (3 layouts x 3 dtypes x 2 tiles): its variants compile in parallel
        # processes first, into the disk cache the cases then read (bench/gpu_variants.py).
        result["precompile"] = gpu_variants.precompile("kernels", torch.cuda.get_device_capability())
    result.update(gpu_kernels.run(smoke=args.smoke, progress=result))


def _oracle(result: dict, args) -> None:
    from bench import gpu_oracle

    with tempfile.TemporaryDirectory() as root:
        # The smoke run checks the wiring: the torch reference spares it triton's slow CPU interpreter.
        backend = "torch" if args.smoke else "triton"
        result.update(gpu_oracle.run(Path(root), args.device, backend, smoke=args.smoke, progress=result))


def _oracle_newer(result: dict, args) -> None:
    from bench import gpu_oracle

    with tempfile.TemporaryDirectory() as root:
        backend = "torch" if args.smoke else "triton"
        result.update(gpu_oracle.run(Path(root), args.device, backend, smoke=args.smoke, newer=True, progress=result))


def decode_argv(device: str, smoke: bool) -> list[str]:
    """bench/gpu_decode.py's arguments in the check. The batch sizes are CUDA-graph buckets, so the
    graphs' greedy tokens can be held to the eager ones'."""
    argv = ["--device", device, "--backends", "triton", "triton-eager"]
    if smoke:
        return argv + [
            "--shape",
            "tiny",
            "--dtype",
            "float32",
            "--batch-sizes",
            "1",
            "4",
            "--prompt-len",
            "8",
            "--decode-tokens",
            "4",
        ]
    return argv + ["--batch-sizes", "1", "8", "64", "128", "--decode-tokens", "48"]


def _decode(result: dict, args) -> None:
    from bench import gpu_decode

    gpu_decode.run(gpu_decode.parse(decode_argv(args.device, args.smoke)), progress=result)


def _w2(result: dict, args) -> None:
    from bench import gpu_w2

    gpu_w2.run(result, args.device, smoke=args.smoke)


def _smoke(result: dict, args) -> None:
    """The first minute: everything imports, one kernel case and one tiny oracle case run."""
    from bench import gpu_kernels, gpu_oracle

    result["kernels"] = gpu_kernels.run(smoke=True)
    with tempfile.TemporaryDirectory() as root:
        backend = "torch" if args.device == "cpu" else "triton"
        result["oracle"] = gpu_oracle.run(
            Path(root), args.device, backend, smoke=True, only_families=["llama"], only_scenarios=["chunked_prefill"]
        )
    result["all_equal"] = result["kernels"]["all_equal"] and result["oracle"]["all_equal"]
    if not result["all_equal"]:
        raise AssertionError("the smoke cases differ from the reference: see kernels and oracle")


SECTIONS = (
    Section("smoke", 40, _smoke),
    Section("kernels", 40, _kernels),
    Section("oracle", 75, _oracle),
    Section("oracle_newer", 55, _oracle_newer),
    Section("decode", 70, _decode),
    Section("w2", 140, _w2),
)


def run_section(section: Section, args, record: Path | None = None) -> dict:
    """Run one section here: {status: ok | failed | timed_out, seconds, ...what it recorded, error}.

    The budget is also enforced from outside (run_in_process's `timeout`); the alarm here turns an
    overrun inside Python into a recorded result instead of a kill.
    """
    result = RecordedResult(record)

    def overrun(signum, frame):
        raise SectionTimeout(f"section {section.name} exceeded its {section.budget_s} s budget")

    previous = signal.signal(signal.SIGALRM, overrun)
    signal.alarm(budget_s(section, args))
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
    outcome = {"status": status, "seconds": round(time.perf_counter() - start, 1), **result}
    if record is not None:
        write_atomically(record, json.dumps(outcome, indent=1, default=str))
    return outcome


def budget_s(section: Section, args) -> int:
    return section.budget_s * (20 if args.smoke else 1)  # the CPU interpreter is slow


def run_in_process(section: Section, args) -> dict:
    """The section in a fresh Python process under coreutils' `timeout`: a hung kernel is killed,
    a CUDA error stays in that process, and the cases it recorded before either are kept."""
    record = args.out / "sections" / f"{section.name}.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.unlink(missing_ok=True)
    limit = budget_s(section, args) + 15  # the in-process alarm fires first; this is for a hang in C
    command = [
        "timeout",
        "--kill-after=10",
        str(limit),
        sys.executable,
        "-m",
        "bench.gpu_check",
        "--run-section",
        section.name,
        "--record",
        str(record),
        "--device",
        args.device,
        *(["--smoke"] if args.smoke else []),
    ]
    start = time.perf_counter()
    done = subprocess.run(command, env=os.environ.copy())
    seconds = round(time.perf_counter() - start, 1)
    recorded = json.loads(record.read_text()) if record.is_file() else {}
    if "status" in recorded:
        return recorded
    status = "timed_out" if done.returncode in (124, 137) else "failed"
    return {
        **recorded,
        "status": status,
        "seconds": seconds,
        "error": f"the section's process ended with exit status {done.returncode} before recording an outcome",
    }


def environment(device: str) -> dict:
    import transformers
    import triton

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": device,
    }
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
    parser.add_argument("--run-section", choices=[s.name for s in SECTIONS], help=argparse.SUPPRESS)
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_section:  # one section, in the process run_in_process started
        section = next(s for s in SECTIONS if s.name == args.run_section)
        return 0 if run_section(section, args, args.record)["status"] == "ok" else 1
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
        report["sections"][section.name] = outcome = run_in_process(section, args)
        print(f"== {section.name}: {outcome['status']} in {outcome['seconds']} s ==", flush=True)
        write_atomically(path, json.dumps(report, indent=1, default=str))
        if section.name == "smoke" and outcome["status"] != "ok":
            print("the smoke section failed: stopping here (the other sections need what it checks)", flush=True)
            break
    print(f"wrote {path}")
    return 0 if all(s["status"] == "ok" for s in report["sections"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
