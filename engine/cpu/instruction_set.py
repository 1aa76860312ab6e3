"""Which x86 instruction-set level the C++ kernels are built for, and what the engine may assume of it.

Three levels matter to tokenloom's CPU backend, each a superset of the one before:

- AVX2: the plain KV layout, float32 FMAs; oneDNN cannot pack bfloat16 layers;
- AVX512: the packed KV layout (AVX-512 F/BW), vdpbf16ps where the CPU has AVX512-BF16;
- AMX: bfloat16 GEMMs and prefill attention on AMX tiles.

The level is the CPU's own (from /proc/cpuinfo) unless TOKENLOOM_CPU_ISA caps it lower. The cap
exists so one machine can build and test what a smaller CPU would run (tests/engine/
test_cpu_isa_levels.py runs the CPU-dependent tests at every level this CPU can execute) and so a
user can build kernels that load on older CPUs of a fleet. It is an environment variable, not a
config key, because it decides how a per-machine library is compiled, as TORCH_EXTENSIONS_DIR
decides where: it belongs to the process, not to a model's configuration.
"""

from __future__ import annotations

import enum
import functools
import os
from pathlib import Path

ISA_ENV_VAR = "TOKENLOOM_CPU_ISA"


class CpuIsa(enum.IntEnum):
    """An instruction-set level; a higher value can run everything a lower one can."""

    AVX2 = 1
    AVX512 = 2
    AMX = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def compiler_flags(self) -> list[str]:
        """-march=native minus what this level lacks, so a capped build is the native one up to the cap."""
        amx_off = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]  # gcc keeps AMX-BF16 without amx-tile
        if self is CpuIsa.AVX2:
            return ["-march=native", "-mno-avx512f", *amx_off]  # no AVX-512 subset survives -mno-avx512f
        if self is CpuIsa.AVX512:
            return ["-march=native", *amx_off]
        return ["-march=native"]

    @property
    def onednn_max_isa(self) -> str:
        """oneDNN's ONEDNN_MAX_CPU_ISA value for this level (what a capped test process sets)."""
        return {CpuIsa.AVX2: "AVX2", CpuIsa.AVX512: "AVX512_CORE_BF16", CpuIsa.AMX: "AVX512_CORE_AMX"}[self]


class CpuIsaError(ValueError):
    """TOKENLOOM_CPU_ISA names no level, or one this CPU cannot execute."""


def detected_isa(flags: str) -> CpuIsa:
    """The level a /proc/cpuinfo `flags` line supports."""
    names = set(flags.split())
    if {"amx_tile", "amx_bf16", "avx512f", "avx512bw"} <= names:
        return CpuIsa.AMX
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= names:
        return CpuIsa.AVX512
    return CpuIsa.AVX2


def resolve_isa(flags: str, requested: str | None) -> CpuIsa:
    """The level to build for: the CPU's own, or `requested` ("avx2", "avx512", "amx", "native") below it."""
    own = detected_isa(flags)
    if requested is None or requested.strip().lower() in ("", "native"):
        return own
    try:
        wanted = CpuIsa[requested.strip().upper()]
    except KeyError:
        choices = ", ".join(level.label for level in CpuIsa)
        raise CpuIsaError(f"{ISA_ENV_VAR}={requested!r} is not a level: use one of {choices} or native") from None
    if wanted > own:
        raise CpuIsaError(
            f"{ISA_ENV_VAR}={wanted.label} but this CPU supports up to {own.label}: "
            f"unset {ISA_ENV_VAR} or choose a level at or below {own.label}"
        )
    return wanted


def kernel_arch_flags() -> list[str]:
    """The -march flags of this process's kernel build: plain -march=native unless a cap lowers the level."""
    if target_isa() == detected_isa(cpuinfo_field("flags")):
        return ["-march=native"]  # also what any non-x86 CPU gets: the cap's flags are x86's
    return target_isa().compiler_flags


@functools.cache
def target_isa() -> CpuIsa:
    """This process's level: the CPU's own, capped by TOKENLOOM_CPU_ISA (read once per process)."""
    return resolve_isa(cpuinfo_field("flags"), os.environ.get(ISA_ENV_VAR))


def cpuinfo_field(name: str) -> str:
    """The first CPU's `name` line of /proc/cpuinfo ("flags", "vendor_id"), its value only; "" where unreadable."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
