"""The Triton variants the device check compiles, counted and compiled for sm_90 without a GPU.

Each compiled variant of a kernel is seconds of a section's budget the first time it is met.
bench/gpu_variants.py builds every launch each section of bench/gpu_check.py makes on the device
(start-up profile, graph capture at every batch size, eager steps of every kind, the kernels
section's own steps) and keys it as triton does; here those counts are held to the sections'
budgets, one launch per variant is compiled for sm_90 (ptxas, as
tests/engine/attention/test_triton_compile.py does) to show triton caches exactly as many, and the
kernels section's parallel precompile is shown to fill the disk cache its launches read.
Needs triton's NVIDIA backend (ptxas), not a device; skips with the reason when there is none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.attention.test_triton_compile import _ptxas_missing_reason

pytestmark = pytest.mark.slow  # compiles for sm_90: the test tiers (CONTRIBUTING.md)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900  # ~40 variants at ~1.5 s each on a busy 2-core machine, plus the models' CPU forwards


def _without_interpreter() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton's default, stated to silence its warning
    return env


@pytest.fixture(scope="module")
def counted() -> dict:
    """bench.gpu_variants --compile: {"sections": {name: counts}, "compiled": {kernel: cache entries}}."""
    reason = _ptxas_missing_reason()
    if reason:
        pytest.skip(reason)
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_variants", "--compile"],
        cwd=ROOT,
        env=_without_interpreter(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    print("\n".join(json.dumps(line) for line in lines))
    return {
        "sections": {line["section"]: line for line in lines if "section" in line},
        "compiled": next(line["compiled"] for line in lines if "compiled" in line),
    }


def test_every_section_is_counted_in_run_order(counted):
    from bench.gpu_check import SECTIONS

    assert list(counted["sections"]) == [s.name for s in SECTIONS]


def test_no_section_spends_more_on_first_time_compiles_than_its_budget_allows(counted):
    over = {
        name: (s["compile_s"], s["allowed_s"])
        for name, s in counted["sections"].items()
        if s["compile_s"] > s["allowed_s"]
    }
    assert not over, f"(seconds of first-time compiles, seconds allowed) per section: {over}"


def test_a_model_layout_compiles_once_per_tile_whatever_its_steps(counted):
    """The engine's sections vary chunk counts (every graph batch size), block sizes (16 and 4),
    windows and max_num_seqs; none of that may split a variant. Left: one variant per layout,
    dtype and tile (decode-only or prefill, window or not)."""
    sections = counted["sections"]
    # One model (the 0.5B layout in bfloat16), graphs and eager: the decode tile and the prefill tile.
    assert sections["decode"]["variants"] == sections["w2"]["variants"] == {"paged_attention": 2, "write_kv": 1}
    # head_dim 16, head_dim 16 with a sliding window (Mistral), head_dim 32 (Qwen3): 3 layouts x 2 tiles.
    assert sections["oracle"]["variants"] == {"paged_attention": 6, "write_kv": 2}
    # Its cases use the decode- and prefill-tile layouts the oracle compiled, plus the bfloat16 MoE.
    assert sections["oracle_newer"]["first_time"] == {"paged_attention": 2, "write_kv": 1}
    # The 0.5B model's launches are those the kernels section compiled at Qwen2.5-0.5B's layout.
    assert sections["decode"]["first_time"] == sections["w2"]["first_time"] == {"paged_attention": 0, "write_kv": 0}
    # 3 layouts x 3 dtypes x 2 tiles; the KV write has no tile, and two layouts share its shape.
    assert sections["kernels"]["variants"] == {"paged_attention": 18, "write_kv": 6}


def test_triton_caches_exactly_the_variants_counted(counted):
    """Compiling one launch per counted key for sm_90 leaves as many entries in triton's own cache:
    the count is triton's, not this module's idea of it."""
    first_time = {}
    for section in counted["sections"].values():
        for kernel, n in section["first_time"].items():
            first_time[kernel] = first_time.get(kernel, 0) + n
    assert counted["compiled"] == first_time


def test_the_parallel_precompile_fills_the_cache_the_launches_then_read(tmp_path):
    """bench.gpu_variants.precompile in worker processes, then the same launches in this one: every
    one is found in triton's disk cache (no new entry appears), so a section pays only the workers."""
    reason = _ptxas_missing_reason()
    if reason:
        pytest.skip(reason)
    env = _without_interpreter() | {"TRITON_CACHE_DIR": str(tmp_path / "cache")}
    script = (
        "import json, os, tempfile\n"
        "from pathlib import Path\n"
        "from bench import gpu_variants as v\n"
        "done = v.precompile('smoke', v.SM90, workers=2)\n"
        "cache = Path(os.environ['TRITON_CACHE_DIR'])\n"
        "before = sorted(p.name for p in cache.iterdir())\n"
        "v.activate_stand_in()\n"
        "with tempfile.TemporaryDirectory() as root:\n"
        "    for case in v.section_cases('smoke'):\n"
        "        for launch in v.case_launches(case, Path(root)):\n"
        "            launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.options)\n"
        "after = sorted(p.name for p in cache.iterdir())\n"
        "print(json.dumps({'done': done, 'before': len(before), 'new': sorted(set(after) - set(before))}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert result.returncode == 0, result.stderr[-4000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert "error" not in outcome["done"] and outcome["done"]["workers"] == 2, outcome
    assert outcome["before"] > 0 and outcome["new"] == [], outcome
