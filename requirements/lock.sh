#!/usr/bin/env bash
# Re-resolves the locked dependency sets from pyproject.toml and requirements/*.in:
#   requirements/cpu.lock   the CPU test environment (.ci/run, the README's set-up command)
#   requirements/cuda.lock  the CUDA environment (a GPU machine's tests; the GPU image takes its runtime part)
# Both are resolved for CPython 3.11 on Linux x86_64, whatever machine runs this.
# The CPU torch wheel comes from TORCH_CPU_WHEELS: a folder of wheels (default /opt/wheels where it
# exists) or PyTorch's CPU index.
set -euo pipefail
cd "$(dirname "$0")/.."

UV_VERSION=0.13.9
command -v uv >/dev/null || python -m pip install --quiet "uv==${UV_VERSION}"

if [[ -z "${TORCH_CPU_WHEELS:-}" ]]; then
    if [[ -d /opt/wheels ]]; then TORCH_CPU_WHEELS=/opt/wheels; else TORCH_CPU_WHEELS=https://download.pytorch.org/whl/cpu; fi
fi
if [[ "$TORCH_CPU_WHEELS" == http* ]]; then cpu_source=(--extra-index-url "$TORCH_CPU_WHEELS" --index-strategy unsafe-best-match)
else cpu_source=(--find-links "$TORCH_CPU_WHEELS"); fi

common=(--python-version 3.11 --python-platform x86_64-manylinux_2_28 --quiet --no-header)
header() { printf '# Locked by `bash requirements/lock.sh` from pyproject.toml and requirements/%s.in.\n# Do not edit by hand.\n' "$1"; }

uv pip compile pyproject.toml requirements/cpu.in --extra test "${common[@]}" "${cpu_source[@]}" -o /tmp/tokenloom-cpu.lock
{ header cpu; cat /tmp/tokenloom-cpu.lock; } > requirements/cpu.lock
uv pip compile pyproject.toml requirements/cuda.in --extra test "${common[@]}" -o /tmp/tokenloom-cuda.lock
{ header cuda; cat /tmp/tokenloom-cuda.lock; } > requirements/cuda.lock
echo "wrote requirements/cpu.lock ($(grep -c '^[a-z]' requirements/cpu.lock) packages) and requirements/cuda.lock ($(grep -c '^[a-z]' requirements/cuda.lock) packages)"
