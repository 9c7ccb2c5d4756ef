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


@pytest.fixture(scope="module")
def vllm_single_process():
    """vLLM's distributed state for one process (world size 1, gloo, a free local port), as its
    parallel layers need to be built; for the module that asks for it."""
    import socket

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel,
                                  init_distributed_environment, initialize_model_parallel)
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1, 1)
        yield
        destroy_model_parallel()
        destroy_distributed_environment()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
