#!/usr/bin/env bash
# The device check, for a lent CUDA GPU: one run under 9 minutes on an H100/H200, nothing to
# install, no CPU kernel build. Sections and budgets: bench/gpu_check.py.
# Run from anywhere: bash bench/gpu_check.sh [extra bench.gpu_check arguments, e.g. --sections w2]
# The log and gpu_check.json go to $OUT when it is set (the lent machine's return folder), else bench/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
unset TRITON_INTERPRET  # the kernels must compile for the GPU, not run in the CPU interpreter
RESULTS="${OUT:-bench/results}"
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
exec > >(tee "$LOG") 2>&1

date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "nvidia-smi not found"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), '| triton', triton.__version__, '| transformers', transformers.__version__)"
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script is for a GPU machine')" || exit 2

start=$SECONDS
# The sections' budgets add up to 520 s; the outer limit only guards against a hang outside them.
timeout 545 python3 -m bench.gpu_check --out "$RESULTS" "$@"
status=$?
echo "device check took $((SECONDS - start)) s; exit status $status"
exit $status
