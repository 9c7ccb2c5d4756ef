#!/usr/bin/env bash
# Compile every torch-free CUDA source (csrc/*.cu, csrc/generated/*.cu) for sm_90 with nvcc,
# so kernel code that does not compile never lands. The torch binding (csrc/*.cpp) needs the
# CUDA build of torch and is compiled by `pip install` on a GPU machine instead.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
[ -x "$NVCC" ] || { echo "check_cuda_compile: nvcc not found (set NVCC)"; exit 1; }
OUTDIR="$(mktemp -d)"; trap 'rm -rf "$OUTDIR"' EXIT
shopt -s nullglob
SOURCES=(csrc/*.cu csrc/generated/*.cu)
[ ${#SOURCES[@]} -gt 0 ] || { echo "check_cuda_compile: no .cu sources"; exit 0; }
printf '%s\n' "${SOURCES[@]}" | xargs -P "$(nproc)" -I{} sh -c \
  '"$0" -arch=sm_90 -std=c++17 -O3 --expt-relaxed-constexpr -Icsrc -c "$1" -o "$2/$(basename "$1").o" || { echo "FAILED: $1"; exit 255; }' \
  "$NVCC" {} "$OUTDIR"
echo "check_cuda_compile: ${#SOURCES[@]} sources compile for sm_90"
