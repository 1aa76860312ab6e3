#!/usr/bin/env bash
# The device check's dry run: bench/gpu_check.sh exactly as the lent GPU machine runs it, on this
# CPU at tiny shapes, so a harness that cannot even start there is found here first.
#
# Like the lent machine it gets a copy of the working tree (tracked files and untracked ones git
# does not ignore, no install) and a Python environment without tokenloom or the packages that
# machine lacks: a fresh venv that sees this environment's packages as plain path entries (no
# editable tokenloom), with the absent ones made unimportable. Every section must end "ok".
#   bash bench/gpu_check.sh --cpu-smoke [--sections ...]
# Results: $OUT (or bench/results/dry_run/) gets gpu_check.json and the log.
set -euo pipefail
cd "$(dirname "$0")/.."
tree="$(pwd)"
python="${PYTHON:-python3}"
# A fixed place per checkout, so the copied tree keeps one path and its CPU kernels stay cached.
scratch="${XDG_CACHE_HOME:-$HOME/.cache}/tokenloom/gpu-dry-run/$(printf '%s' "$tree" | sha1sum | cut -c1-12)"
results="${OUT:-$tree/bench/results/dry_run}"
mkdir -p "$scratch" "$results"

# The tree as the device tool copies it.
rm -rf "$scratch/tree.new"
mkdir -p "$scratch/tree.new"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -co --exclude-standard -z | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$scratch/tree.new"
else  # already a plain copy (a `git archive`, the device's own copy): take it whole, less build output
    tar --exclude=./bench/results --exclude='__pycache__' -cf - . | tar -xf - -C "$scratch/tree.new"
fi
rm -rf "$scratch/tree" && mv "$scratch/tree.new" "$scratch/tree"

# The environment: this interpreter's packages, minus tokenloom and what the lent machine lacks.
if [[ ! -x "$scratch/venv/bin/python3" ]]; then
    "$python" -m venv --without-pip "$scratch/venv"
fi
site="$("$scratch/venv/bin/python3" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
"$python" - "$site" <<'PY'
import sys
from pathlib import Path

site = Path(sys.argv[1])
ours = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
(site / "tested-environment.pth").write_text("".join(f"{p}\n" for p in ours))
# Packages tokenloom can use that the lent GPU machine does not have (its image: the device tool's
# KINDS.md). Importing one there fails; here it must fail the same way.
absent = ["xgrammar", "bitsandbytes", "sqlalchemy", "alembic", "celery", "kombu", "redis", "psycopg",
          "fastapi", "uvicorn", "openai", "schemathesis", "importlinter"]
(site / "_device_absent.py").write_text(
    "import importlib.abc, sys\n"
    f"ABSENT = {absent!r}\n"
    "class _Absent(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ABSENT:\n"
    "            raise ModuleNotFoundError(f'No module named {name!r} (absent on the GPU machine)', name=name)\n"
    "        return None\n"
    "sys.meta_path.insert(0, _Absent())\n"
)
(site / "device-absent.pth").write_text("import _device_absent\n")
PY
# tokenloom itself is not importable here: the plain path entries skip the editable install's
# .pth hook, so bench/gpu_check.sh must find it in the tree (bench/tree_imports.sh), as on the device.

cd "$scratch/tree"
env -u PYTHONPATH PATH="$scratch/venv/bin:$PATH" OUT="$results" TRITON_INTERPRET=1 \
    TOKENLOOM_GPU_CHECK_DEVICE=cpu bash bench/gpu_check.sh "$@"
