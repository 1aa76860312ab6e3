"""One Triton kernel launch as a value: the kernel, its grid, its arguments and its launch options.

The launchers (`paged_attention`, `write_kv`) build one of these and run it. Building the launch
apart from running it lets tests/engine/attention/test_triton_compile.py compile for sm_90 exactly what the
engine would launch for a given layout (same specialisation, same tiles, same num_warps) on a
machine without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    kernel: Any  # a triton.jit function (an InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: tuple[Any, ...]  # the kernel's runtime arguments, in order
    options: dict[str, Any]  # constexpr arguments by name, plus launch options (num_warps)

    def run(self) -> None:
        self.kernel[self.grid](*self.args, **self.options)
