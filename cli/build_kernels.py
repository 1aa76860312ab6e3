"""`tokenloom build-kernels`: compile the C++ CPU kernels ahead of the first engine start.

The Dockerfile and .ci/run call it so no engine start (or test) pays for the one-time build;
the library is cached per source digest, torch version and CPU flags, so running it again is
a fast no-op on the same machine.
"""

from __future__ import annotations

import argparse
import sys
import time

BUILD_KERNELS_HELP = """\
Build tokenloom's C++ CPU kernels for this machine's CPU now (about a minute on 2 cores, once),
instead of at the first engine start. Exit 0 when they are built (or already were), 1 when
they cannot be built here; the message then says what to install.

TOKENLOOM_CPU_ISA=avx2|avx512|amx caps the instruction set they are built for below this CPU's
own (default: native), e.g. to run what an AVX2-only machine of a fleet would run."""


def add_commands(commands) -> None:
    build = commands.add_parser(
        "build-kernels", help="build the C++ CPU kernels now (one time, about a minute)", description=BUILD_KERNELS_HELP
    )
    build.set_defaults(handler=cmd_build_kernels)


def cmd_build_kernels(args: argparse.Namespace) -> int:
    from tokenloom.engine import CpuKernelsUnavailable, kernel_library_path, load_cpu_kernels, target_isa

    start = time.perf_counter()
    try:
        load_cpu_kernels()
    except CpuKernelsUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(
        f"CPU kernels for {target_isa().label} ready in {time.perf_counter() - start:.1f} s: {kernel_library_path()}",
        file=sys.stderr,
    )
    return 0
