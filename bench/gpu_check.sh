#!/usr/bin/env bash
# ONE command for a GPU machine (well inside 8 minutes): put the carried wheels (bench/gpu_wheels.sh)
# on PYTHONPATH without touching the image's torch/triton, then run bench/gpu_check.py: kernels
# vs references, CUDA-IPC gradient parity at W=2 (processes sharing the one GPU if that is all
# there is), its transport bandwidth, kernel bandwidth vs copy_, W=4, NVSHMEM. Writes
# gpu_check.log and gpu_check.json under $OUT (else /tmp/odcfn-gpu-check). Without a GPU it says so
# and exits 0.
#   usage: bench/gpu_check.sh [--cpu] [gpu_check.py args, e.g. --world 2]
#     --cpu   dry run on this CPU machine: TRITON_INTERPRET=1, --device cpu, no wheel install
#   on a GPU machine: copy the checkout with .gpu-wheels/, then  OUT=gpu-check-out bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
WHEELS=${GPU_WHEELS:-$REPO/.gpu-wheels}
LOGDIR=${OUT:-${TMPDIR:-/tmp}/odcfn-gpu-check}
mkdir -p "$LOGDIR"
LOG=$LOGDIR/gpu_check.log
DRY=0
if [ "${1:-}" = "--cpu" ]; then
  DRY=1
  shift
fi

main() {
  if [ "$DRY" = 1 ]; then
    export TRITON_INTERPRET=1 PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
    set -- --device cpu "$@"
  else
    if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
      echo "gpu_check: no NVIDIA GPU here (nvidia-smi missing or lists none): skipped"
      return 0
    fi
    nvidia-smi -L
    unset TRITON_INTERPRET
    SITE=${GPU_SITE:-/tmp/odcfn-gpu-site}
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
      # --target + --no-deps: the wheels land in SITE alone; the image's packages stay as they are
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl || { echo "gpu_check: FAILED: installing $WHEELS"; return 1; }
      if ! PYTHONPATH=$SITE "$PY" -c "from cuda.core import Buffer, Device, MemoryResource, ObjectCode, system" \
        2>/dev/null && compgen -G "$WHEELS/fallback/*.whl" >/dev/null; then
        echo "gpu_check: the image's cuda.core is too old for nvshmem4py: adding $WHEELS/fallback"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target "$SITE" "$WHEELS"/fallback/*.whl || echo "gpu_check: fallback install failed (NVSHMEM will skip)"
      fi
    else
      echo "gpu_check: no wheels in $WHEELS (bench/gpu_wheels.sh makes them; copy .gpu-wheels/ with the checkout)"
    fi
    export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}
    export TRITON_DEFAULT_FP_FUSION=1
  fi
  export PYTHONUNBUFFERED=1

  # the script first prints what it imports (python, torch, triton, optree and odcfn: their
  # versions and paths; it stops there if one does not import), then skips sections once its
  # 360 s budget is spent; timeout is the backstop
  timeout 420 "$PY" bench/gpu_check.py --budget 360 --json "$LOGDIR/gpu_check.json" "$@"
  rc=$?
  [ "$rc" = 124 ] && echo "gpu_check: FAILED: ran past 420 s (the JSON holds the sections finished before)"
  echo "gpu_check: exit $rc; log $LOG, results $LOGDIR/gpu_check.json"
  return "$rc"
}

main "$@" 2>&1 | tee "$LOG"  # everything, the install included, lands in the log
exit "${PIPESTATUS[0]}"
