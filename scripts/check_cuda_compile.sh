#!/usr/bin/env bash
# Compile every torch-free CUDA source (csrc/*.cu, csrc/generated/*.cu) for sm_80 and sm_90a
# (the shipped targets; sm_90a carries the wgmma kernel), so kernel code that does not compile
# never lands, and fail where ptxas says it serialized the asynchronous wgmma pipeline; then the torch binding (csrc/*.cpp)
# against the installed torch's headers, with declaration-only stand-ins for the CUDA library
# headers the CPU machine lacks (scripts/cuda_stubs). Object files only: nothing is linked.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
[ -x "$NVCC" ] || { echo "check_cuda_compile: nvcc not found (set NVCC)"; exit 1; }
OUTDIR="$(mktemp -d)"; trap 'rm -rf "$OUTDIR"' EXIT
shopt -s nullglob
SOURCES=(csrc/*.cu csrc/generated/*.cu)
[ ${#SOURCES[@]} -gt 0 ] || { echo "check_cuda_compile: no .cu sources"; exit 0; }
printf '%s\n' "${SOURCES[@]}" | xargs -P "$(nproc)" -I{} sh -c \
  'log=$("$0" -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90a,code=sm_90a -DKBIT_HAS_SM90A -std=c++17 -O3 --expt-relaxed-constexpr -Icsrc -c "$1" -o "$2/$(basename "$1").o" 2>&1) || { echo "$log"; echo "FAILED: $1"; exit 255; }; [ -n "$log" ] && echo "$log"; if echo "$log" | grep -q "wgmma.*serialized"; then echo "FAILED: $1 (wgmma serialized)"; exit 255; fi; exit 0' \
  "$NVCC" {} "$OUTDIR"
echo "check_cuda_compile: ${#SOURCES[@]} sources compile for sm_80 and sm_90a"

TORCH_INC="$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')"
PY_INC="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
for f in csrc/*.cpp; do
  "$NVCC" -x cu -arch=sm_90a -std=c++20 --expt-relaxed-constexpr -c "$f" -o "$OUTDIR/$(basename "$f").o" -Iscripts/cuda_stubs -Icsrc \
    -I"$TORCH_INC" -I"$TORCH_INC/torch/csrc/api/include" -I"$PY_INC" || { echo "FAILED: $f"; exit 1; }
done
echo "check_cuda_compile: the torch binding compiles"
