#!/usr/bin/env bash
# Build a binary wheel of vllm_kbit against the torch of this environment (for vLLM 0.24: torch
# 2.11, CUDA 13) with kernels for sm_80, sm_86, sm_89 and sm_90a (the wgmma kernel is sm_90a
# code), into OUTDIR (default dist/). Needs a CUDA torch and the CUDA toolkit; the wheel then
# installs where neither nvcc nor the CUDA headers are: `pip install --no-deps vllm_kbit-*.whl`.
#   scripts/build_wheel.sh [OUTDIR]     (TORCH_CUDA_ARCH_LIST and MAX_JOBS override the defaults)
set -euo pipefail
cd "$(dirname "$0")/.."
OUTDIR="$(mkdir -p "${1:-dist}" && cd "${1:-dist}" && pwd)"
PY="${PYTHON:-python3}"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-8.0 8.6 8.9 9.0a}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
"$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 'build_wheel: torch ' + torch.__version__ + ' is a CPU build; a wheel with kernels needs a CUDA torch')"
echo "build_wheel: torch $("$PY" -c 'import torch; print(torch.__version__)'), TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS"
t0=$(date +%s)
# --no-build-isolation: compiled against this environment's torch, the one it will run with
"$PY" -m pip wheel --no-build-isolation --no-deps --no-index -w "$OUTDIR" .
WHEEL="$(ls -t "$OUTDIR"/vllm_kbit-*.whl | head -1)"
"$PY" - "$WHEEL" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert any(n.startswith("vllm_kbit/_C") and n.endswith(".so") for n in names), "the wheel has no vllm_kbit/_C extension"
PY
echo "build_wheel: $WHEEL, $(du -h "$WHEEL" | cut -f1), built in $(( $(date +%s) - t0 )) s"
