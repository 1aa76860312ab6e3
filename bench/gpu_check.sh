#!/usr/bin/env bash
# One prepared check for a lent CUDA GPU, under 8 minutes on an H100/H200:
#   1. the Triton kernel, selection and engine-equality tests, compiled for CUDA (no interpreter);
#   2. the decode throughput table (bench/gpu_check.py): Triton vs torch backend vs transformers.
# Run from anywhere: bash bench/gpu_check.sh [extra bench.gpu_check arguments]
# The log and JSON go to $OUT when it is set (the lent machine's return folder), else bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # the kernels must compile for the GPU, not run in the CPU interpreter
RESULTS="${OUT:-bench/results}"
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
exec > >(tee "$LOG") 2>&1

date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi not found"
python -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), '| triton', triton.__version__, '| transformers', transformers.__version__)"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script is for a GPU machine')" || exit 2

status=0
echo "== 1/2 Triton tests on CUDA =="
start=$SECONDS
timeout 240 python -m pytest -q -rs -p no:cacheprovider tests/engine/test_triton_*.py || status=1
echo "tests took $((SECONDS - start)) s"

echo "== 2/2 decode throughput =="
start=$SECONDS
timeout 300 python -m bench.gpu_check --json "$RESULTS/gpu_check.json" "$@" || status=1
echo "throughput took $((SECONDS - start)) s; exit status $status"
exit $status
