#!/usr/bin/env bash
# Download the wheels the target GPU image lacks (Python 3.12, x86_64, no network there) into
# .gpu-wheels/ (git-ignored), check they install together for that target, and print the size to
# copy to the GPU machine with the checkout (kept under 64 MiB, working tree included).
#   usage: bench/gpu_wheels.sh [DIR]          then, on the GPU machine: bench/gpu_check.sh
#
# What the image has and lacks (docs/gpu.md, as documented for that machine): torch 2.11.0+cu130,
# triton 3.6.0, nvidia-nvshmem-cu13 3.4.5 (torch's pin), cuda-bindings/-core/-pathfinder, numpy,
# einops, safetensors, matplotlib: all there. Missing:
#   optree            odcfn's core imports it
#   nvshmem4py-cu13   the NVSHMEM host API (init, symmetric tensors); only the NVSHMEM sections
#                     need it, ~5 MB. Its own needs (nvidia-nvshmem-cu13, cuda-core>=0.5,
#                     cuda-pathfinder>=1.2.3, numpy) are in the image, cuda-core's version unread.
# fallback/ holds cuda-core and cuda-pathfinder, which gpu_check.sh installs only where the
# image's cuda.core is too old for nvshmem4py (`from cuda.core import Buffer` fails).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.gpu-wheels}
PY=${PYTHON:-python3}
WHEELS=(optree==0.20.0 nvshmem4py-cu13==0.4.1)
FALLBACK=(cuda-core==1.2.2 cuda-pathfinder==1.9.1)
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64
        --platform any)

rm -rf "$DIR"
mkdir -p "$DIR/fallback"
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$DIR" "${WHEELS[@]}"
"$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$DIR/fallback" "${FALLBACK[@]}"

# the same install gpu_check.sh does there, for the device's tags: one version of each, no clash
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip install -q --no-index --no-deps "${TARGET[@]}" --target "$tmp/a" "$DIR"/*.whl
"$PY" -m pip install -q --no-index --no-deps "${TARGET[@]}" --target "$tmp/b" "$DIR"/fallback/*.whl

ls -l "$DIR"/*.whl "$DIR"/fallback/*.whl | awk '{printf "%10d  %s\n", $5, $NF}'
wheels=$(cat "$DIR"/*.whl "$DIR"/fallback/*.whl | wc -c)
# what else travels: tracked files plus untracked, not ignored ones (git's own view of the tree)
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 cat 2>/dev/null | wc -c)
total=$((wheels + tree))
limit=$((64 << 20))
awk -v w="$wheels" -v t="$tree" -v s="$total" -v l="$limit" 'BEGIN {
  printf "wheels %.1f MiB + working tree %.1f MiB = %.1f MiB to copy (limit %.0f MiB)\n",
         w / 2^20, t / 2^20, s / 2^20, l / 2^20 }'
if [ "$total" -ge "$limit" ]; then
  echo "gpu_wheels: FAILED: over the 64 MiB kept as the limit of what is copied" >&2
  exit 1
fi
