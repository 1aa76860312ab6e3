"""The CPU-dependent tests at every instruction-set level below this CPU's own.

The suite runs on whichever CPU a machine has (AVX2-only, AVX-512 or AMX), and each kind takes
other kernel paths: the plain or packed KV layout, oneDNN bfloat16 packing or none, AMX tiles or
FMAs. So that a green run on one kind says the others are green too, this test runs the tests
whose paths depend on the CPU again in a fresh process capped to each lower level: the kernels
rebuilt for it (TOKENLOOM_CPU_ISA), and torch, oneDNN and MKL held to it by their own switches,
so the process takes the decisions a CPU of that kind would. A level above this CPU's own cannot
run here; the note says which.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenloom.engine.cpu.instruction_set import ISA_ENV_VAR, CpuIsa, cpuinfo_field, detected_isa

pytestmark = pytest.mark.slow  # the test tiers (CONTRIBUTING.md): not in the fast loop

REPO = Path(__file__).resolve().parents[3]

# Every test module whose kernels, layouts or expectations change with the instruction set, and
# the engine oracles that run through them.
LEVEL_DEPENDENT_TESTS = [
    "tests/engine/cpu/test_cpu_instruction_set.py",
    "tests/engine/cpu/test_cpu_kernels.py",
    "tests/engine/cpu/test_cpu_backend.py",
    "tests/engine/cpu/test_cpu_linear.py",
    "tests/engine/cpu/test_brgemm_linear.py",
    "tests/engine/cpu/test_packed_kv.py",
    "tests/engine/cpu/test_decoder_stack.py",
    "tests/engine/cpu/test_row_argmax.py",
    "tests/engine/runner/test_device_defaults.py",
    "tests/engine/runner/test_kv_dtype.py",
    "tests/engine/oracle/test_greedy_oracle.py",
]

# What torch, oneDNN and MKL would choose on a CPU of each level (each library's own switch).
LIBRARY_CAPS = {
    CpuIsa.AVX2: dict(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2"),
    CpuIsa.AVX512: dict(
        ATEN_CPU_CAPABILITY="avx512", ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16", MKL_ENABLE_INSTRUCTIONS="AVX512"
    ),
}


@pytest.mark.parametrize("level", sorted(LIBRARY_CAPS), ids=lambda level: level.label)
def test_cpu_dependent_tests_pass_at_each_lower_level(level):
    own = detected_isa(cpuinfo_field("flags"))
    if os.environ.get(ISA_ENV_VAR):
        pytest.skip(f"this run is itself capped ({ISA_ENV_VAR}={os.environ[ISA_ENV_VAR]}): it is one of the levels")
    if level >= own:
        pytest.skip(
            f"this CPU is {own.label}: the suite itself runs the {own.label} paths"
            if level == own
            else f"this CPU is {own.label}: it cannot execute {level.label} code"
        )
    env = {**os.environ, ISA_ENV_VAR: level.label, **LIBRARY_CAPS[level]}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *LEVEL_DEPENDENT_TESTS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "(no output)"
    print(f"{level.label}: {summary}")
    assert done.returncode == 0, f"at {level.label}:\n{done.stdout[-6000:]}\n{done.stderr[-2000:]}"
