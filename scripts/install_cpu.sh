#!/usr/bin/env bash
# Install vllm_kbit and its test dependencies on a CPU-only machine (CI, laptops) into
# $PYTHON (default python3; a virtual environment's, ideally). torch 2.13.0 comes from
# PyTorch's CPU index where it answers, else from pip's configured index; vLLM 0.24 without its
# CUDA dependencies; this package reference-only. scripts/install_cpu.py says why, step by step.
#   scripts/install_cpu.sh [--torch-index URL|none]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
exec "${PYTHON:-python3}" "$HERE/install_cpu.py" "$@"
