"""Shared test setup.

- `gpu` marks tests that need a CUDA GPU (and the built extension); they skip without one.
- On a machine without CUDA, vLLM is pointed at its CPU platform before anything imports its
  model layers (vLLM picks CpuPlatform only for "cpu" builds; the CUDA wheel installed with
  scripts/install_cpu.sh would otherwise be "UnspecifiedPlatform").
"""
import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the vllm_kbit._C extension")
    if not torch.cuda.is_available():
        try:
            import vllm.platforms as platforms
            from vllm.platforms.cpu import CpuPlatform
        except ImportError:
            return
        platforms._current_platform = CpuPlatform()
        platforms.current_platform = platforms._current_platform


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
