"""The GPU check's harness, run end to end on this CPU at tiny shapes.

bench/gpu_check.sh only ever runs on a lent GPU, with minutes of device time per task: a harness
that broke since it last ran (an engine API it calls, a config field it sets, the report's table)
would spend that time failing. These runs time nothing; they prove every section of the check
still goes from checkpoint to JSON, and the decode table from both backends and the transformers
peer to its columns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import get_default_build_root

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

ROOT = Path(__file__).resolve().parents[2]


def _env(tmp_path: Path) -> dict:
    env = dict(os.environ)
    # The tiny checkpoint goes to a scratch cache; the C++ kernels the session already built stay where they are.
    env["TORCH_EXTENSIONS_DIR"] = get_default_build_root()
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    env["TRITON_INTERPRET"] = "1"  # --device cpu: the Triton backend runs in triton's CPU interpreter, GPU or not
    return env


def test_the_decode_table_runs_on_a_cpu_with_both_backends_and_the_transformers_peer(tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.gpu_decode",
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--backends",
            "triton",
            "torch",
            "--batch-sizes",
            "1",
            "3",
            "--prompt-len",
            "8",
            "--decode-tokens",
            "5",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    header, rows = table[0], [line for line in table[1:] if "---" not in line]
    for column in (
        "tokenloom triton step ms",
        "tokenloom torch step ms",
        "transformers generate step ms",
        "triton vs torch",
        "triton = torch tokens",
    ):
        assert column in header
    assert [row.split("|")[1].strip() for row in rows] == ["1", "3"]
    # float32: the two backends must pick the same greedy tokens (the check's last column says so).
    assert all(row.rstrip(" |").endswith("100%") for row in rows), rows
    saved = json.loads(out.read_text())
    assert [row["batch"] for row in saved["rows"]] == [1, 3]
    for row in saved["rows"]:
        for system in ("triton", "torch", "hf"):
            # Every system's step time is a median of measured steps (never a difference of two
            # timings), so it is positive however fast the machine is.
            assert row[system]["step_ms"] > 0
            assert row[system]["e2e_tok_s"] > 0


def test_the_transformers_peer_times_each_decode_step_of_generate():
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.gpu_decode import SHAPES, hf_generate

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES["tiny"], bos_token_id=1, eos_token_id=2)).eval()
    ids = torch.randint(3, 384, (2, 8))
    steps, wall = hf_generate(model, ids, 5, "cpu")
    assert len(steps) == 4  # 5 new tokens: the first comes from the prefill, then 4 decode steps
    assert all(step > 0 for step in steps)
    assert sum(steps) <= wall  # the steps lie inside the call: measured, not differenced


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="with a CUDA device the script runs the whole GPU check (minutes)"
)
def test_the_gpu_script_stops_with_a_reason_on_a_machine_without_cuda(tmp_path):
    env = _env(tmp_path)
    env["OUT"] = str(tmp_path / "out")  # the lent machine's return folder; the log goes there
    result = subprocess.run(
        ["bash", "bench/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert "no CUDA device: this script is for a GPU machine" in log
    assert "torch " in log and "triton " in log  # the versions line ran before the refusal


def test_the_device_run_goes_through_every_section_on_a_bare_copy_of_the_tree(tmp_path):
    """bash bench/gpu_check.sh --cpu-smoke: the script as the lent GPU machine runs it (a copy of
    the tree, nothing installed, no tokenloom and none of the packages that machine lacks), on this
    CPU at tiny shapes. Every section, each in its own process, must end ok."""
    from bench.gpu_check import SECTIONS

    env = _env(tmp_path)
    env["OUT"] = str(tmp_path / "out")
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--cpu-smoke"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500
    )
    log = (tmp_path / "out" / "gpu_check.log").read_text() if (tmp_path / "out" / "gpu_check.log").is_file() else ""
    assert result.returncode == 0, log[-4000:] + result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert (
        list(report["sections"])
        == [s.name for s in SECTIONS]
        == ["smoke", "kernels", "oracle", "oracle_newer", "decode", "w2"]
    )
    assert all(s["status"] == "ok" for s in report["sections"].values()), report["sections"]
    sections = report["sections"]
    assert sections["smoke"]["all_equal"]
    assert (
        sections["kernels"]["all_equal"] and sections["oracle"]["all_equal"] and sections["oracle_newer"]["all_equal"]
    )
    assert sections["oracle"]["cases"][0]["swap_outs"] > 0
    assert {"triton", "triton-eager", "hf"} <= set(sections["decode"]["rows"][0])
    assert set(sections["w2"]["systems"]) == {"tokenloom", "tokenloom-eager", "hf-static-64", "hf-generate-batch"}
    # Each section also left its own record, the one a killed section would leave.
    assert sorted(p.stem for p in (tmp_path / "out" / "sections").glob("*.json")) == sorted(s.name for s in SECTIONS)
    assert "tokenloom cannot be imported" not in log
    # Graph tokens are held to eager tokens at the same batch sizes (equal here: a CPU runs no graphs).
    assert all(row["graph_tokens_equal_eager"] == 1.0 for row in sections["decode"]["rows"])
    assert any("bfloat16 graphs vs eager" in case["scenario"] for case in sections["oracle_newer"]["cases"])
    assert (
        sections["w2"]["systems"]["hf-generate-batch"]["output_tokens"] == sections["w2"]["workload"]["output_tokens"]
    )


def test_a_tree_that_cannot_import_tokenloom_stops_with_one_line(tmp_path):
    """The check refuses at once, naming the tree, when tokenloom cannot be imported from it."""
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    for name in ("gpu_check.sh", "tree_imports.sh", "gpu_check.py"):
        (tree / "bench" / name).write_bytes((ROOT / "bench" / name).read_bytes())
    (tree / "engine").mkdir()  # an engine folder without the engine
    env = _env(tmp_path)
    env.update(OUT=str(tmp_path / "out"), TOKENLOOM_GPU_CHECK_DEVICE="cpu", PYTHONPATH="")
    venv_python = _bare_python(tmp_path)
    env["PATH"] = f"{venv_python.parent}:{env['PATH']}"
    result = subprocess.run(
        ["bash", str(tree / "bench" / "gpu_check.sh")], cwd=tree, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 3
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    assert f"error: tokenloom cannot be imported from {tree}" in log


def _bare_python(tmp_path: Path) -> Path:
    """A venv seeing this environment's packages as plain paths: no editable tokenloom in it."""
    import venv

    venv.create(tmp_path / "venv")
    python = tmp_path / "venv" / "bin" / "python3"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (Path(site) / "tested-environment.pth").write_text("".join(f"{p}\n" for p in ours))
    return python


def test_a_section_records_each_case_as_it_goes(tmp_path):
    """What a section sets reaches its record at once: a section killed later keeps it."""
    from bench.gpu_check import RecordedResult

    record = tmp_path / "section.json"
    result = RecordedResult(record)
    result["cases"] = [{"equal": True}]
    assert json.loads(record.read_text()) == {"cases": [{"equal": True}]}
    result.update(all_equal=True)
    assert json.loads(record.read_text()) == {"cases": [{"equal": True}], "all_equal": True}


def test_a_section_that_raises_is_recorded_and_the_next_one_still_runs(tmp_path):
    import argparse

    from bench.gpu_check import Section, SectionTimeout, run_section

    def broken(result, args):
        result["partial"] = 1
        raise RuntimeError("kernel mismatch")

    def slow(result, args):
        raise SectionTimeout("over budget")

    args = argparse.Namespace(smoke=False)
    failed = run_section(Section("broken", 5, broken), args)
    assert failed["status"] == "failed" and "kernel mismatch" in failed["error"] and failed["partial"] == 1
    assert run_section(Section("slow", 5, slow), args)["status"] == "timed_out"
    assert run_section(Section("fine", 5, lambda result, args: result.update(x=2)), args) == {
        "status": "ok",
        "seconds": 0.0,
        "x": 2,
    }
