"""A CUDA device without the kbit CUDA extension: importing vllm_kbit still works, creating a
kbit layer fails naming what is missing and the build command, unless VLLM_KBIT_REFERENCE=1.

Runs on the CPU: the extension's import is made to fail and torch.cuda.is_available to say yes."""
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("vllm")

from vllm_kbit import ops  # noqa: E402

from test_vllm_layers import make_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("vllm_single_process")  # vLLM's parallel state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The child blocks or breaks `import vllm_kbit._C`, claims a CUDA GPU of compute capability 9.0,
# imports vllm_kbit.ops and calls require_kernels; it prints what it saw as one JSON line.
CHILD = textwrap.dedent("""
    import json, logging, sys
    import torch
    mode = sys.argv[1]
    if mode == "missing":
        sys.modules["vllm_kbit._C"] = None  # ModuleNotFoundError for vllm_kbit._C
    else:
        class Broken:
            def find_spec(self, name, path=None, target=None):
                if name == "vllm_kbit._C":
                    raise (ImportError if mode == "import_error" else OSError)(
                        "vllm_kbit/_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEa")
        sys.meta_path.insert(0, Broken())
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
    import vllm_kbit.ops as ops
    out = {"has": ops.HAS_CUDA_KERNELS, "error": ops.KERNELS_ERROR}
    try:
        ops.require_kernels("model.layers.0.mlp.down_proj")
        out["raised"] = None
    except ops.KernelsUnavailableError as e:
        out["raised"] = str(e)
    print("RESULT " + json.dumps(out))
""")


def run_child(mode, reference=False):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_KBIT_REFERENCE"}
    if reference:
        env["VLLM_KBIT_REFERENCE"] = "1"
    p = subprocess.run([sys.executable, "-c", CHILD, mode], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr  # the import itself never fails
    line = next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), p.stderr


@pytest.mark.parametrize("mode, kind, text", [
    ("missing", "not built", "ModuleNotFoundError"),
    ("import_error", "built but fails to load", "ImportError: vllm_kbit/_C.so: undefined symbol"),
    ("os_error", "built but fails to load", "OSError: vllm_kbit/_C.so: undefined symbol"),
])
def test_missing_or_broken_extension_fails_at_layer_creation_not_at_import(mode, kind, text):
    out, stderr = run_child(mode)
    assert out["has"] is False and out["error"].startswith(kind) and text in out["error"], out
    msg = out["raised"]
    assert msg is not None, "a kbit layer on a CUDA device without the kernels must not be created"
    assert "model.layers.0.mlp.down_proj" in msg and out["error"] in msg
    assert "TORCH_CUDA_ARCH_LIST=9.0a pip install --no-build-isolation -e ." in msg
    assert f"cd {ROOT} &&" in msg  # the source folder of this checkout
    assert "VLLM_KBIT_REFERENCE=1" in msg
    assert "vllm_kbit._C" in stderr and kind in stderr  # the import-time warning says it too


@pytest.mark.parametrize("mode", ["missing", "import_error"])
def test_reference_requested_allows_kbit_layers_without_the_extension(mode):
    out, _ = run_child(mode, reference=True)
    assert out["raised"] is None and out["has"] is False
    assert "VLLM_KBIT_REFERENCE=1" in out["error"]


@pytest.fixture
def fake_gpu_without_kernels(monkeypatch):
    """This process as one on an sm_86 GPU whose extension fails to load."""
    def broken(name, *args, **kwargs):
        raise ImportError(f"{name}: undefined symbol: _ZN2at4_ops5empty4callE")
    monkeypatch.setattr(ops.importlib, "import_module", broken)
    error = ops._load_extension()
    assert error.startswith("built but fails to load (ImportError:")
    monkeypatch.setattr(ops, "HAS_CUDA_KERNELS", False)
    monkeypatch.setattr(ops, "KERNELS_ERROR", error)
    monkeypatch.setattr(ops, "REFERENCE_REQUESTED", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    return error


def create(prefix):
    from vllm_kbit.linear import KbitLinearMethod
    layer = torch.nn.Module()
    KbitLinearMethod(make_config(4), prefix).create_weights(
        layer, 64, [96], 64, 96, torch.bfloat16, weight_loader=lambda *a, **k: None)
    return layer


def test_kbit_linear_method_refuses_a_gpu_without_kernels(fake_gpu_without_kernels, monkeypatch):
    prefix = "model.layers.3.self_attn.o_proj"
    with pytest.raises(ops.KernelsUnavailableError) as e:
        create(prefix)
    msg = str(e.value)
    assert prefix in msg and fake_gpu_without_kernels in msg
    assert "TORCH_CUDA_ARCH_LIST=8.6 pip install --no-build-isolation -e ." in msg

    monkeypatch.setattr(ops, "REFERENCE_REQUESTED", True)  # VLLM_KBIT_REFERENCE=1
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("vllm.kbit").addHandler(handler)
    try:
        layer = create(prefix)
    finally:
        logging.getLogger("vllm.kbit").removeHandler(handler)
    assert layer.qweight.shape == (96, 64 // 32 * 4) and layer.absmax.shape == (96, 2)
    # the engine's log says what its kbit layers run (benchmarks/e2e.py refuses figures without kernels)
    assert [r.getMessage() for r in records] == ["vllm_kbit: kbit layers run the PyTorch reference (VLLM_KBIT_REFERENCE=1)"]


def test_no_gpu_or_kernels_loaded_creates_layers(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(ops, "HAS_CUDA_KERNELS", False)
    monkeypatch.setattr(ops, "REFERENCE_REQUESTED", False)
    assert create("a").qweight.dtype == torch.int32  # a CPU machine: the reference serves
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops, "HAS_CUDA_KERNELS", True)
    assert create("b").absmax.dtype == torch.uint8
