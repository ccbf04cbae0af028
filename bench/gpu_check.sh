#!/usr/bin/env bash
# ONE command for a GPU machine (under 8 minutes): make sure torch(CUDA)+triton+odcfn import,
# then run bench/gpu_check.py: Triton kernels vs torch references on the GPU, the CUDA-IPC
# transport with W=2 and W=4 processes (sharing one GPU if that is all there is; nccl for the
# collective path when there is a GPU per rank, else gloo), gradient parity with the
# single-process reference and the collective path, NVSHMEM where >= 2 GPUs exist, and kernel
# bandwidth against the device's own copy_ bandwidth. The summary table is printed last.
# Without a GPU it says so and exits 0.
#   usage: bench/gpu_check.sh [--world 2 4]        log: $OUT/gpu_check.log when OUT is set
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi missing or lists none): skipped"
  exit 0
fi
nvidia-smi -L

need() {
  "$PY" - <<'PYEOF'
import torch, triton  # noqa: F401
import odcfn  # noqa: F401
assert torch.cuda.is_available(), "torch sees no GPU (CPU build?)"
PYEOF
}
if ! need 2>/dev/null; then
  echo "gpu_check: installing odcfn[gpu] (needs a CUDA torch and network or a local wheelhouse)"
  "$PY" -m pip install -q -e '.[gpu]' ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} || true
  if ! need; then
    echo "gpu_check: FAILED: torch with CUDA, triton and odcfn must import (see above)"
    exit 1
  fi
fi

export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
unset TRITON_INTERPRET
LOG=${OUT:-/tmp}/gpu_check.log
timeout 470 "$PY" bench/gpu_check.py "$@" 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && echo "gpu_check: FAILED: ran past 470 s"
exit "$rc"
