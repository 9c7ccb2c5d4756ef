"""`python3 -m vllm_kbit.check`: on this CPU machine, and on a faked GPU without the kernels."""
import io
import os
import subprocess
import sys

import pytest
import torch

from vllm_kbit import check, ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_check(**env):
    env = {**{k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_KBIT_REFERENCE")}, **env}
    return subprocess.run([sys.executable, "-m", "vllm_kbit.check"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's report")
def test_check_on_a_cpu_machine():
    p = run_check()
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert f"at {os.path.join(ROOT, 'vllm_kbit')}" in out and f"torch {torch.__version__}" in out
    assert "extension vllm_kbit._C: not built (ModuleNotFoundError" in out
    assert "GPU: none visible" in out and "reference" in out
    assert "FP8 activations (quantization_config.activations or --hf-overrides kbit_activations = fp8): " \
           "the PyTorch reference (vllm_kbit.fp8)" in out
    assert "the `kbit` quantization method is registered" in out and "OK:" in out


def test_check_fails_where_vllm_does_not_see_kbit():
    pytest.importorskip("vllm")
    p = run_check(VLLM_PLUGINS="some_other_plugin")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "PROBLEM: vLLM" in p.stdout and "VLLM_PLUGINS does not list kbit" in p.stdout


@pytest.fixture
def fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake H100")
    monkeypatch.setattr(check, "_vllm_sees_kbit", lambda: (True, "fake"))


def test_check_fails_on_a_gpu_without_the_extension(fake_gpu, monkeypatch):
    monkeypatch.setattr(ops, "HAS_CUDA_KERNELS", False)
    monkeypatch.setattr(ops, "REFERENCE_REQUESTED", False)
    monkeypatch.setattr(ops, "KERNELS_ERROR", "built but fails to load (ImportError: undefined symbol: _ZN3c10)")
    out = io.StringIO()
    assert check.run(out) == 1
    text = out.getvalue()
    assert "GPU: Fake H100, compute capability 9.0" in text
    assert "PROBLEM: the extension is built but fails to load (ImportError: undefined symbol" in text
    assert "TORCH_CUDA_ARCH_LIST=9.0a pip install --no-build-isolation -e ." in text
    assert "needs a CUDA GPU" not in text and check.gpu_problem() is not None

    monkeypatch.setattr(ops, "REFERENCE_REQUESTED", True)
    out = io.StringIO()
    assert check.run(out) == 1 and "VLLM_KBIT_REFERENCE=1 is set" in out.getvalue()
    assert check.gpu_problem() is None  # the reference on purpose serves


def test_check_fails_on_an_old_gpu(fake_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    out = io.StringIO()
    assert check.run(out) == 1 and "need compute capability 8.0 or newer, this GPU is 7.5" in out.getvalue()
    assert "sm_75" in check.gpu_problem()


@pytest.mark.parametrize("archs, cc, covered", [
    ("8.0;8.6;8.9;9.0a", (8, 0), True), ("8.0;8.6;8.9;9.0a", (8, 6), True), ("8.0;8.6;8.9;9.0a", (9, 0), True),
    ("8.0", (8, 9), True),             # sm_80 SASS runs on later 8.x
    ("9.0a", (8, 0), False), ("9.0a", (10, 0), False), ("8.6", (8, 0), False),
    ("8.0;8.6;8.9;9.0a", (12, 0), False), ("8.0+PTX", (12, 0), True), ("9.0a+PTX", (10, 0), False),
    ("8.0 9.0", (9, 0), True),
])
def test_arch_covered(archs, cc, covered):
    assert check.arch_covered(archs, *cc) is covered


@pytest.mark.gpu
def test_check_on_the_gpu_passes():
    p = run_check()
    assert p.returncode == 0, p.stdout + p.stderr
    assert "GEMV (M = 1): ok" in p.stdout and "OK: kbit layers use the CUDA kernels" in p.stdout
    assert "MoE experts (moe_gemm, 2 tokens x top-2): ok" in p.stdout


def test_check_without_vllm_is_not_ok():
    # the converter works without vLLM, serving does not: the check says so and fails
    code = "import sys; sys.modules['vllm'] = None; from vllm_kbit.check import run; sys.exit(run())"
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_PLUGINS", "VLLM_KBIT_REFERENCE")}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "vLLM: not importable" in p.stdout and "PROBLEM: vLLM is not installed" in p.stdout
    assert "OK:" not in p.stdout and "pip install vllm==0.24.0" in p.stdout


def test_gpu_problem_says_what_is_missing_once():
    if torch.cuda.is_available():
        pytest.skip("the message of a machine without a GPU")
    assert check.gpu_problem() == "no CUDA GPU is visible (torch.cuda.is_available() is False)"
