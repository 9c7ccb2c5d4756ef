"""The CPU side of benchmarks/peers.py and its hooks in bench_gemm.py / bench_decode.py: bytes per
weight of each format, the --peers selection, failures captured as results, the tables."""
import io
import os
import subprocess
import sys
from contextlib import redirect_stdout

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_decode as bd  # noqa: E402
import peers as pe  # noqa: E402


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_kbit_bytes_per_weight_is_the_tensors_size(bits):
    from vllm_kbit import layout as kl
    n, k = 256, 1024
    size = kl.packed_numel(n, k, bits) * 4 + kl.absmax_numel(n, k)  # int32 bit planes + absmax bytes
    assert pe.bytes_per_weight("kbit", bits, 32) == pytest.approx(size / (n * k), rel=0, abs=1e-12)


def test_bytes_per_weight_of_each_format():
    assert pe.bytes_per_weight("kbit", 4, 32) == 0.53125
    assert pe.bytes_per_weight("gemlite", 4, 64) == 0.5 + 4 / 64
    assert pe.bytes_per_weight("gemlite", 2, 64) == 0.3125
    assert pe.bytes_per_weight("tinygemm", 4, 32) == 0.625
    assert pe.bytes_per_weight("gptq", 4, 128) == 0.515625
    # ExLlama: q [k*b/32, n] int32, zeros [k/g, n*b/32] int32, scales [k/g, n] fp16
    n, k, g = 4096, 4096, 128
    for b in (2, 3, 4, 8):
        size = (k * b // 32) * n * 4 + (k // g) * (n * b // 32) * 4 + (k // g) * n * 2
        assert pe.bytes_per_weight("exllama", b, g) == pytest.approx(size / (n * k), abs=1e-12)
    with pytest.raises(ValueError, match="nf4"):
        pe.bytes_per_weight("nf4", 4, 64)


def test_select_expands_families_and_filters_bits():
    names = [p.name for p in pe.select("all", [2, 4])]
    assert names == ["gemlite-w4g64", "gemlite-w2g64", "tinygemm-w4g32", "tinygemm-w4g64",
                     "tinygemm-w4g128", "gptq-w4g128", "gptq-w2g128", "exllama-w4g128", "exllama-w2g128"]
    assert [p.name for p in pe.select("exllama", [3])] == ["exllama-w3g128"]
    # an explicit name is kept whatever the bit filter, and a repeat is dropped
    assert [p.name for p in pe.select("gemlite-w2g128,tinygemm,gemlite-w2g128", [2])] == ["gemlite-w2g128"]
    assert pe.select("", None) == [] and pe.select("none", None) == []
    assert pe.select("tinygemm-w4g64", None)[0].dtype == torch.bfloat16
    assert pe.select("tinygemm-w4g64", None)[0].bpw == 0.5625


@pytest.mark.parametrize("spec, word", [("bnb", "bnb"), ("tinygemm-w2g64", "tinygemm-w2g64"),
                                        ("gemlite-w4g8", "gemlite-w4g8"), ("foo-w4g64", "foo")])
def test_select_names_what_it_refuses(spec, word):
    with pytest.raises(ValueError, match=word):
        pe.select(spec, None)


def test_try_make_captures_failures():
    # a K that no group divides fails before any device work, with the peer named
    fn, wb, err = pe.try_make(pe.Peer("tinygemm", 4, 128), 256, 4000)
    assert fn is None and wb == 0 and "tinygemm-w4g128" in err and "4000" in err
    if not torch.cuda.is_available():  # every family fails cleanly without a GPU
        for p in pe.select("all", None):
            fn, wb, err = pe.try_make(p, 256, 1024)
            assert fn is None and isinstance(err, str) and err, p.name


def test_vllm_gptq_refuses_2_and_3_bits():
    pytest.importorskip("vllm.model_executor.layers.quantization.auto_gptq")
    for bits in (2, 3):
        fn, _, err = pe.try_make(pe.Peer("gptq", bits, 128), 4096, 4096)
        assert fn is None and err.startswith("ValueError") and f"bits={bits}" in err


def test_describe_error_is_one_line():
    e = RuntimeError("first line\nsecond line")
    assert pe.describe_error(e) == "RuntimeError: first line"
    assert pe.describe_error(KeyError()) == "KeyError"


def test_row_labels_name_the_kernel_a_peer_delegates_to():
    assert pe.label("gptq-w4g128", {"kernel": "MacheteLinearKernel"}) == "gptq-w4g128 (Machete)"
    assert pe.label("exllama-w3g128", {"kernel": "gptq_gemm"}) == "exllama-w3g128"
    assert pe.label("kbit4", {}) == "kbit4"


def test_gpu_tag():
    assert pe.gpu_tag("NVIDIA H100 80GB HBM3") == "h100"
    assert pe.gpu_tag("NVIDIA H200") == "h200"
    assert pe.gpu_tag("NVIDIA A100-SXM4-80GB") == "a100"
    assert pe.gpu_tag("NVIDIA GeForce RTX 4090") == "nvidia_geforce_rtx_4090"


def _step(method, m, us, bpw):
    return {"method": method, "m": m, "what": "step", "us": us, "bpw": bpw}


def test_k2_vs_k4_and_the_peers_table():
    results = [_step("kbit4", 1, 1600.0, 0.531), _step("kbit2", 1, 1200.0, 0.281), _step("kbit4", 16, 2000.0, 0.531),
               _step("cublas-fp16", 1, 6000.0, 2.0), _step("gemlite-w2g64", 1, 1500.0, 0.3125),
               {"method": "between", "m": 1, "what": "step", "us": 10.0}]
    assert bd.k2_vs_k4(results, [1, 16]) == {1: pytest.approx(1600 / 1200)}
    errors = [{"method": "gptq-w2g128", "m": None, "error": "ValueError: Unsupported quantization config: bits=2"}] * 2
    meta = {"model": "llama3-8b", "layers": 32, "gpu": "GPU", "commit": "c"}
    out = io.StringIO()
    with redirect_stdout(out):
        bd.peers_summary(results, errors, [1, 16], meta)
    lines = out.getvalue().splitlines()
    body = [ln.split() for ln in lines if ln and not ln.startswith("#")]
    assert body[0] == ["method", "B/w", "M=1", "M=16"]
    assert [r[0] for r in body[1:]] == ["kbit2", "kbit4", "cublas-fp16", "gemlite-w2g64"]  # kbit, baselines, peers
    assert body[2] == ["kbit4", "0.531", "1600", "2000"] and body[1][3] == "-"
    assert sum("not run: gptq-w2g128" in ln for ln in lines) == 1  # once per distinct error


@pytest.mark.parametrize("script", ["bench_gemm.py", "bench_decode.py"])
def test_help_runs_without_a_gpu(script):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--help"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--peers" in r.stdout and "--gemlite-tune" in r.stdout
