"""Builds and loads tokenloom's C++ CPU kernels (engine/cpu/csrc/*.cpp) as torch ops, once per machine.

torch compiles them with the machine's C++ compiler the first time an engine needs them (about a
minute on 2 cores) and caches the library under $TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions); later starts load it in milliseconds. The library's name carries a
digest of the sources, the torch version, the compiler flags and this CPU's instruction-set flags,
so an upgrade, a different CPU (-march=native) or a TOKENLOOM_CPU_ISA cap (instruction_set.py)
builds a fresh one instead of loading a stale or illegal one.
The ops run on torch's own intra-op thread pool: the extension links the same OpenMP runtime
that torch loaded (same soname), so there is still one team of threads per process.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

from tokenloom.engine.cpu.instruction_set import CpuIsaError, cpuinfo_field, kernel_arch_flags

log = logging.getLogger("tokenloom.engine")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
# -ffast-math lets gcc vectorise expf through glibc's libmvec; the kernels never produce inf/NaN
# from finite inputs (softmax subtracts the row maximum, which is a real score).
# The instruction-set flags between them (-march=native, or lower under TOKENLOOM_CPU_ISA:
# instruction_set.py) keep a native build's command line, and so its cached library, unchanged.
OPTIMIZE_FLAGS = ["-O3"]
CODEGEN_FLAGS = ["-mprefer-vector-width=512", "-fopenmp", "-ffast-math"]


def compiler_flags() -> list[str]:
    return [*OPTIMIZE_FLAGS, *kernel_arch_flags(), *CODEGEN_FLAGS]


class CpuKernelsUnavailable(RuntimeError):
    """The kernels could not be built or loaded here; the message says why and what to install."""


_lock = threading.Lock()
_loaded: bool = False
_failure: str | None = None


def load_cpu_kernels() -> None:
    """Make torch.ops.tokenloom_cpu.* available, building the library if needed; raises CpuKernelsUnavailable."""
    global _loaded, _failure
    with _lock:
        if _loaded:
            return
        if _failure is not None:
            raise CpuKernelsUnavailable(_failure)
        try:
            _build_and_load()
        except CpuIsaError as err:  # a wrong cap is the user's setting to change, not a missing compiler
            _failure = str(err)
            raise CpuKernelsUnavailable(_failure) from err
        except Exception as err:  # a missing compiler/ninja, a compile error: all mean "not here"
            _failure = (
                f"tokenloom's C++ CPU kernels could not be built ({type(err).__name__}: {_first_line(err)}); "
                "they need a C++ compiler (apt install g++) and ninja (pip install ninja)"
            )
            raise CpuKernelsUnavailable(_failure) from err
        _loaded = True


def cpu_kernels_loaded() -> bool:
    """Whether torch.ops.tokenloom_cpu.* are available in this process (never builds them)."""
    return _loaded


def kernel_library_path() -> Path:
    """Where this machine's build of the kernels lives (or will), under $TORCH_EXTENSIONS_DIR."""
    from torch.utils import cpp_extension

    name = _library_name()
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    return Path(root) / name / f"{name}.so"


def _library_name() -> str:
    return f"tokenloom_cpu_{_digest()}"


def _build_and_load() -> None:
    from torch.utils import cpp_extension

    name = _library_name()
    library = kernel_library_path()
    if not library.is_file():
        # Said before the compiler starts, so a first start does not look hung for a minute.
        log.info(
            "building tokenloom's C++ CPU kernels for this CPU: one time, about a minute on 2 cores "
            "(cached in %s; `tokenloom build-kernels` does this ahead of time)",
            library.parent,
        )
    start = time.perf_counter()
    library.parent.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(
        name=name,
        build_directory=str(library.parent),
        sources=[str(p) for p in SOURCES],
        extra_cflags=compiler_flags(),
        extra_ldflags=["-fopenmp"],
        is_python_module=False,  # the library registers torch ops; nothing to import
        verbose=False,
    )
    seconds = time.perf_counter() - start
    if seconds > 2:
        log.info("built tokenloom's C++ CPU kernels in %.0f s (cached for later starts)", seconds)


def _digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):  # headers too: a change to one must rebuild
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    # Ninja's build file names the sources by absolute path: two checkouts of the same code sharing
    # one build directory would each see the other's build as stale and rebuild it at every start.
    digest.update(str(CSRC.resolve()).encode())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(compiler_flags()).encode())
    digest.update(cpuinfo_field("flags").encode())
    return digest.hexdigest()[:16]


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else "no message"
