#!/usr/bin/env bash
# Compile every torch-free CUDA source (csrc/**/*.cu) for sm_80 and sm_90a
# (the shipped targets; sm_90a carries the wgmma kernel), so kernel code that does not compile
# never lands, and fail where ptxas says it serialized the asynchronous wgmma pipeline; then the torch binding (csrc/*.cpp)
# against the installed torch's headers, with declaration-only stand-ins for the CUDA library
# headers the CPU machine lacks (scripts/cuda_stubs). Object files only: nothing is linked.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
[ -x "$NVCC" ] || { echo "check_cuda_compile: nvcc not found (set NVCC)"; exit 1; }
OUTDIR="$(mktemp -d)"; trap 'rm -rf "$OUTDIR"' EXIT
python3 csrc/generate_instantiations.py --check  # the per-bit-width files are what the script writes
shopt -s nullglob
mapfile -t SOURCES < <(find csrc -name "*.cu" | sort)
[ ${#SOURCES[@]} -gt 0 ] || { echo "check_cuda_compile: no .cu sources"; exit 0; }
printf '%s\n' "${SOURCES[@]}" | xargs -P "$(nproc)" -I{} sh -c \
  'log=$("$0" -gencode arch=compute_80,code=sm_80 -gencode arch=compute_90a,code=sm_90a -DKBIT_HAS_SM90A -std=c++17 -O3 --expt-relaxed-constexpr -Icsrc -c "$1" -o "$2/$(echo "$1" | tr / _).o" 2>&1) || { echo "$log"; echo "FAILED: $1"; exit 255; }; [ -n "$log" ] && echo "$log"; if echo "$log" | grep -q "wgmma.*serialized"; then echo "FAILED: $1 (wgmma serialized)"; exit 255; fi; exit 0' \
  "$NVCC" {} "$OUTDIR"
echo "check_cuda_compile: ${#SOURCES[@]} sources compile for sm_80 and sm_90a"

# The wgmma kernel's 128-token tiles hand registers from the producer warpgroup to the consumers
# (setmaxnreg 40 / 232, wgmma/config.cuh Cfg::kProducer): the raise waits until the pool holds
# 8 x 232 + 4 x 40 registers a warp, which needs the launch's 168 a thread (64 K / 384). Any
# other count (a changed launch bound, -maxrregcount) would hang the kernel, so it fails here.
# cuobjdump: on PATH, next to nvcc, or the copy triton ships (installed with vLLM's dependencies)
CUOBJDUMP="${CUOBJDUMP:-$(command -v cuobjdump || true)}"
[ -n "$CUOBJDUMP" ] || [ ! -x "$(dirname "$NVCC")/cuobjdump" ] || CUOBJDUMP="$(dirname "$NVCC")/cuobjdump"
[ -n "$CUOBJDUMP" ] || CUOBJDUMP="$(python3 -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))' 2>/dev/null || true)"
[ -n "$CUOBJDUMP" ] && [ -x "$CUOBJDUMP" ] || { echo "check_cuda_compile: cuobjdump not found (set CUOBJDUMP)"; exit 1; }
for o in "$OUTDIR"/*wgmma_k*.cu.o; do
  regs=$("$CUOBJDUMP" --dump-resource-usage -arch sm_90a "$o" | grep -A1 "wgmma_kernelILi[0-9]ELi128ELi256ELi2E" \
         | grep -o "REG:[0-9]*" || true)
  [ -n "$regs" ] || { echo "FAILED: $(basename "$o"): no 128-token tile instantiation found"; exit 1; }
  bad=$(echo "$regs" | grep -v -x "REG:168" || true)
  [ -z "$bad" ] || { echo "FAILED: $(basename "$o"): producer tiles launch with $bad, not 168 registers"; exit 1; }
done
# the grouped MoE kernel's producer builds (one CTA per SM, moe/grouped_kernel.cuh) make the same hand-over
for o in "$OUTDIR"/*moe_grouped_k*.cu.o; do
  regs=$("$CUOBJDUMP" --dump-resource-usage -arch sm_90a "$o" | grep -A1 -E "moe_grouped_kernelILi[0-9]ELi[0-9]+ELi1E" \
         | grep -o "REG:[0-9]*" || true)
  [ -n "$regs" ] || { echo "FAILED: $(basename "$o"): no producer build of the grouped MoE kernel found"; exit 1; }
  bad=$(echo "$regs" | grep -v -x "REG:168" || true)
  [ -z "$bad" ] || { echo "FAILED: $(basename "$o"): grouped MoE producer builds launch with $bad, not 168 registers"; exit 1; }
done
echo "check_cuda_compile: the wgmma producer tiles launch with 168 registers"

TORCH_INC="$(python3 -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')"
PY_INC="$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
for f in csrc/*.cpp; do
  "$NVCC" -x cu -arch=sm_90a -std=c++20 --expt-relaxed-constexpr -c "$f" -o "$OUTDIR/$(basename "$f").o" -Iscripts/cuda_stubs -Icsrc \
    -I"$TORCH_INC" -I"$TORCH_INC/torch/csrc/api/include" -I"$PY_INC" || { echo "FAILED: $f"; exit 1; }
done
echo "check_cuda_compile: the torch binding compiles"
