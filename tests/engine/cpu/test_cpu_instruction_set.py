"""The instruction-set level the CPU kernels are built for (engine/cpu/instruction_set.py)."""

from __future__ import annotations

import subprocess

import pytest

from tokenloom.engine.cpu.instruction_set import CpuIsa, CpuIsaError, detected_isa, resolve_isa

ZEN3 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2 sha_ni vaes"
ZEN4 = ZEN3 + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS = ZEN4 + " amx_bf16 amx_tile amx_int8 avx512_fp16"


@pytest.mark.parametrize(
    "flags, level",
    [(ZEN3, CpuIsa.AVX2), (ZEN4, CpuIsa.AVX512), (SAPPHIRE_RAPIDS, CpuIsa.AMX), ("", CpuIsa.AVX2)],
    ids=["avx2-only", "avx512", "amx", "unreadable"],
)
def test_the_level_is_read_from_the_cpu_flags(flags, level):
    assert detected_isa(flags) == level


def test_avx512_needs_all_four_subsets_the_packed_kernels_use():
    assert detected_isa(ZEN3 + " avx512f avx512bw") == CpuIsa.AVX2


@pytest.mark.parametrize("requested", [None, "", "native", " NATIVE "])
def test_no_cap_means_the_cpus_own_level(requested):
    assert resolve_isa(SAPPHIRE_RAPIDS, requested) == CpuIsa.AMX


def test_a_cap_lowers_the_level_and_is_case_insensitive():
    assert resolve_isa(SAPPHIRE_RAPIDS, "AVX2") == CpuIsa.AVX2
    assert resolve_isa(ZEN4, "avx512") == CpuIsa.AVX512


def test_a_cap_above_the_cpu_says_what_it_supports():
    with pytest.raises(CpuIsaError, match="supports up to avx2") as err:
        resolve_isa(ZEN3, "avx512")
    assert "unset TOKENLOOM_CPU_ISA" in str(err.value)


def test_an_unknown_cap_lists_the_levels():
    with pytest.raises(CpuIsaError, match="avx2, avx512, amx or native"):
        resolve_isa(ZEN4, "sse4")


@pytest.mark.parametrize("level", list(CpuIsa))
def test_each_levels_flags_define_exactly_its_instruction_macros(level):
    """The compiler, asked for each level, defines the macros the kernels key on (csrc) and no more."""
    macros = subprocess.run(
        ["g++", "-x", "c++", *level.compiler_flags, "-dM", "-E", "-"], input="", capture_output=True, text=True
    )
    if macros.returncode != 0:
        pytest.skip(f"g++ cannot preprocess for this machine: {macros.stderr.strip()[:200]}")
    defined = {line.split()[1] for line in macros.stdout.splitlines() if line.startswith("#define")}
    own = detected_isa(open("/proc/cpuinfo").read())
    if level > own:
        pytest.skip(f"this CPU is {own.label}: -march=native cannot show {level.label}'s macros here")
    assert "__AVX2__" in defined
    assert ("__AVX512F__" in defined) == (level >= CpuIsa.AVX512)
    assert ("__AMX_BF16__" in defined) == (level >= CpuIsa.AMX)
    if level < CpuIsa.AVX512:
        assert not {m for m in defined if m.startswith(("__AVX512", "__AMX"))}
