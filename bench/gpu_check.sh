#!/usr/bin/env bash
# The device check, for a lent CUDA GPU: one run under 8 minutes on an H100/H200, on a bare copy
# of this tree (nothing installed, no network, no CPU kernel build). Sections, budgets and results:
# bench/gpu_check.py. The log and gpu_check.json (plus one JSON per section) go to $OUT when it is
# set (the lent machine's return folder), else bench/results/.
#
#   bash bench/gpu_check.sh                    # on the GPU machine
#   bash bench/gpu_check.sh --sections smoke   # only the first minute's smoke section
#   bash bench/gpu_check.sh --cpu-smoke        # the whole harness, as the device runs it, on this CPU
#                                              # (bench/gpu_check_dry_run.sh; CI runs it)
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--cpu-smoke" ]]; then
    shift
    exec bash bench/gpu_check_dry_run.sh "$@"
fi
RESULTS="${OUT:-bench/results}"
mkdir -p "$RESULTS"
LOG="$RESULTS/gpu_check.log"
exec > >(tee "$LOG") 2>&1

DEVICE_ARGS=()
if [[ "${TOKENLOOM_GPU_CHECK_DEVICE:-cuda}" == cpu ]]; then
    DEVICE_ARGS=(--device cpu --smoke)  # the dry run: Triton kernels in triton's CPU interpreter
else
    unset TRITON_INTERPRET  # the kernels must compile for the GPU, not run in the CPU interpreter
fi

date -u
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi not found"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), '| triton', triton.__version__, '| transformers', transformers.__version__)"
if [[ ${#DEVICE_ARGS[@]} -eq 0 ]]; then
    python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script is for a GPU machine')" || exit 2
fi

# tokenloom.* from this tree when it is not installed (the lent machine installs nothing).
if ! python3 -c "import tokenloom.engine.loop.engine" 2>/dev/null; then
    source bench/tree_imports.sh
fi
python3 -c "import tokenloom.engine.loop.engine, bench.gpu_check" || {
    echo "error: tokenloom cannot be imported from $(pwd) (the traceback above says which module); nothing was measured"
    exit 3
}

start=$SECONDS
# Each section runs in its own process under its own budget (bench/gpu_check.py); this outer
# limit only guards against a hang outside them.
timeout 500 python3 -m bench.gpu_check --out "$RESULTS" "${DEVICE_ARGS[@]}" "$@"
status=$?
echo "device check took $((SECONDS - start)) s; exit status $status"
exit $status
