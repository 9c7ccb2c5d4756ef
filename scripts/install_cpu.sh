#!/usr/bin/env bash
# Install vllm_kbit and its test dependencies on a CPU-only machine (CI, laptops).
#
# vLLM 0.24.0 pins torch==2.11.0 (a CUDA build). Its Python layers import and run on the
# CPU wheel of torch 2.13.0, so: torch 2.13.0 first, then the vLLM wheel without its
# dependencies, then the pure-Python packages it needs (pinned in the file beside this one),
# always constrained to that torch so pip never pulls a CUDA build.
# pip reports a conflict with vLLM's torch pin and exits 0: that is expected.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
CONSTRAINT="$(mktemp)"; trap 'rm -f "$CONSTRAINT"' EXIT
echo "torch==2.13.0" > "$CONSTRAINT"

"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q --no-deps "vllm==0.24.0"
"$PY" -m pip install -q -r "$HERE/cpu-vllm-0.24-requirements.txt" -c "$CONSTRAINT" 2>&1 \
  | grep -v -E "vllm 0.24.0 requires torch|dependency resolver does not currently" || true
# the plugin itself (no CUDA torch here, so setup.py skips the extension)
"$PY" -m pip install -q --no-build-isolation --no-deps -e "$HERE/.."
"$PY" -c "import torch, vllm, vllm_kbit; print('torch', torch.__version__, '| vllm', vllm.__version__)"
