"""FP8 activations (vllm_kbit.fp8): the reference against an independent float64 evaluation of
its definition, the choice by M, the config field, the converter flag, the serve-time override
through vLLM's hf_overrides, and vLLM's layers on the CPU computing the reference's function."""
import json
import math
import zlib
from pathlib import Path
from unittest import mock

import pytest
import torch

from vllm_kbit import format as kf
from vllm_kbit import fp8, ops
from vllm_kbit.quant import default_codebook

DTYPES = (torch.float16, torch.bfloat16)


def e4m3_round(v: torch.Tensor) -> torch.Tensor:
    """e4m3 (1-4-3, bias 7, max 448) round-to-nearest-even with saturation, written from the
    format's definition in float64 (not through torch's float8 cast)."""
    v = v.double().clamp(-448.0, 448.0)
    _, e = torch.frexp(v)                                        # |v| = m 2^e, 0.5 <= m < 1
    quantum = torch.ldexp(torch.ones_like(v), (e - 1).clamp_min(-6) - 3)  # 3 mantissa bits; subnormals below 2^-6
    return torch.round(v / quantum) * quantum                    # torch.round: half to even


def direct_activations(x):
    """Step 1 from its definition: (x_q as float64, s_x float32 [M, 1])."""
    amax = x.float().abs().amax(-1, keepdim=True)
    s_x = torch.maximum(amax / torch.tensor(448.0), torch.tensor(1.0 / (448 * 512), dtype=torch.float32))
    return e4m3_round(x.float() / s_x), s_x                       # fp32 division, then e4m3


def direct_weight(qweight, absmax, cb, bits, w_exp):
    """Step 3 from its definition, element by element from the checkpoint tensors (float64)."""
    n = absmax.shape[0]
    idx = kf.unpack_bitplanes(qweight, bits).long().reshape(n, -1, 32)
    scale = kf.e4m4_table().double()[absmax.long()].unsqueeze(-1)
    w16 = (cb.half().double()[idx] * scale * 2.0 ** w_exp).reshape(n, -1).to(torch.float16)
    return e4m3_round(w16.double())


def direct_fp8_linear(x, qweight, absmax, cb, bits, w_exp, bias=None):
    """Steps 1-4 in float64: (w_q, y)."""
    x_q, s_x = direct_activations(x)
    w_q = direct_weight(qweight, absmax, cb, bits, w_exp)
    y = (x_q @ w_q.t()) * s_x.double() * 2.0 ** -w_exp
    if bias is not None:
        y = y + bias.double()
    return w_q, y


def random_layer(n, k, bits, gen, std=0.05, cb=None):
    w = torch.randn(n, k, generator=gen) * std
    cb = default_codebook(bits) if cb is None else cb
    q, a = kf.quantize(w, bits, cb)
    return q, a, cb


def test_weight_exponent_is_the_largest_that_fits():
    table = kf.e4m4_table().double()
    for code in range(1, 256):
        r = fp8.weight_exponent(torch.tensor([[0, code], [code // 2, 1]], dtype=torch.uint8))
        top = table[code].item()
        assert top * 2.0 ** r <= 448.0 < top * 2.0 ** (r + 1), code
    # 1.75 * 2^8 = 448 exactly: the bound is inclusive
    code = int(kf.encode_e4m4(torch.tensor(1.75)))
    assert kf.decode_e4m4(torch.tensor(code, dtype=torch.uint8)).item() == 1.75
    assert fp8.weight_exponent(torch.tensor([code], dtype=torch.uint8)) == 8
    assert fp8.weight_exponent(torch.zeros(3, 4, dtype=torch.uint8)) == 0
    with pytest.raises(ValueError, match="absmax must be the uint8 E4M4 codes"):
        fp8.weight_exponent(torch.ones(3, dtype=torch.float32))


def test_e4m3_rounding_ties_saturation_and_subnormals():
    v = torch.tensor([17.0, 19.0, 1.0625, 1.1875, 460.0, 1e6, -500.0, 2.0 ** -10, 3 * 2.0 ** -11,
                      2.0 ** -6 + 2.0 ** -10, 0.0, -0.0])
    want = [16.0, 20.0, 1.0, 1.25, 448.0, 448.0, -448.0, 0.0, 2.0 ** -9, 2.0 ** -6, 0.0, 0.0]
    assert e4m3_round(v).tolist() == want
    assert fp8.to_e4m3(v).double().tolist() == want


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_activations_matches_the_definition(dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(str(dtype).encode()))
    x = (torch.randn(37, 96, generator=gen) * torch.logspace(-3, 2, 37).unsqueeze(1)).to(dtype)
    x[3] = 0  # an all-zero token: the floor scale, zeros out
    x[5, 7] = 1e4 if dtype == torch.bfloat16 else 6e4  # one outlier sets its token's scale
    x_q, s_x = fp8.quantize_activations(x)
    ref_q, ref_s = direct_activations(x)
    assert x_q.dtype == torch.float8_e4m3fn and s_x.dtype == torch.float32 and s_x.shape == (37, 1)
    assert torch.equal(s_x, ref_s) and torch.equal(x_q.double(), ref_q)
    assert s_x[3].item() == pytest.approx(1.0 / (448 * 512)) and not x_q[3].double().any()
    assert x_q.double().abs().amax(-1).max().item() == 448.0  # each token's largest maps to 448


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
def test_reference_equals_a_direct_float64_evaluation(bits, dtype, bias):
    gen = torch.Generator().manual_seed(zlib.crc32(f"ref-{bits}-{dtype}-{bias}".encode()))
    n, k, m = 72, 160, 29
    # block scales over three decades: small blocks reach e4m3's subnormals
    q, a, cb = random_layer(n, k, bits, gen, std=0.05)
    a = (a.int() - torch.randint(0, 48, a.shape, generator=gen)).clamp(0, 255).to(torch.uint8)
    r = fp8.weight_exponent(a)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    w_q, y_ref = direct_fp8_linear(x, q, a, cb, bits, r, b)
    assert torch.equal(fp8.decode_weight(q, a, cb, bits, r).double(), w_q)
    y = torch.full((m, n), float("nan"), dtype=dtype)
    y[:] = fp8.gemm_fp8_reference(x, q, a, cb, bits, n, k, r, b)
    assert y.dtype == dtype and torch.isfinite(y).all()
    # the same sum in another order: one rounding of the output apart at most
    ulp = torch.finfo(dtype).eps * y_ref.abs().clamp_min(1e-3)
    assert ((y.double() - y_ref).abs() <= ulp).all()
    # and FP8's error against the 16-bit layer is what e4m3 costs (a few %), not a wrong scale
    exact = x.double() @ kf.dequantize(q, a, bits, cb, dtype=torch.float64).t() + (b.double() if bias else 0)
    assert 1e-3 < ((y.double() - exact).norm() / exact.norm()).item() < 0.08


def test_decoded_weight_uses_the_fp16_codebook_and_fits_e4m3():
    """One weight per code at the layer's largest scale: w_q is the e4m3 of fp16(fp16(cb) x
    absmax x 2^r), and none saturates."""
    bits = 4
    cb = default_codebook(bits)
    idx = torch.arange(32) % 16
    q = kf.pack_bitplanes(idx.to(torch.uint8).reshape(1, 32), bits)
    a = torch.tensor([[kf.encode_e4m4(torch.tensor(0.3))]], dtype=torch.uint8)
    r = fp8.weight_exponent(a)
    w_q = fp8.decode_weight(q, a, cb, bits, r).double()[0]
    top = kf.decode_e4m4(a).double().item() * 2.0 ** r
    assert top <= 448 and w_q.abs().max().item() <= 448
    want = e4m3_round((cb.half().double()[idx] * top).half().double())
    assert torch.equal(w_q, want)


@pytest.mark.parametrize("m", [1, 16, 17, 64])
def test_gemm_keeps_16_bit_activations_in_the_gemv_range(m):
    gen = torch.Generator().manual_seed(m)
    n, k, bits = 48, 128, 4
    q, a, cb = random_layer(n, k, bits, gen)
    r = fp8.weight_exponent(a)
    x = torch.randn(2, m, k, generator=gen).to(torch.bfloat16)[0]
    y = fp8.gemm(x.unsqueeze(0), q, a, cb, bits, n, k, r)[0]
    want = (ops.gemm(x, q, a, cb, bits, n, k) if m <= fp8.GEMV_MAX_M
            else fp8.gemm_fp8_reference(x, q, a, cb, bits, n, k, r))
    assert torch.equal(y, want)
    with pytest.raises(ValueError, match="x has 64 features .* k = 128"):
        fp8.gemm(x[:, :64], q, a, cb, bits, n, k, r)


def test_linear_fp8_op_schema_and_fake():
    gen = torch.Generator().manual_seed(5)
    q, a, cb = random_layer(32, 64, 3, gen)
    x = torch.randn(20, 64, generator=gen).to(torch.float16)
    args = (x, q, a, cb, 3, 32, 64, fp8.weight_exponent(a), torch.randn(32, generator=gen).to(torch.float16))
    torch.library.opcheck(torch.ops.kbit.linear_fp8.default, args, test_utils=("test_schema", "test_faketensor"))


# ----------------------------------------------------------------------------- the setting

def test_check_activations_names_the_field():
    assert fp8.check_activations("auto") == "auto"
    assert fp8.check_activations("fp8") == "fp8"
    for bad in ("FP8", "fp16", "e4m3", True, None, 8):
        with pytest.raises(ValueError, match=r"quantization_config\.activations must be one of 'auto', 'fp8'"):
            fp8.check_activations(bad)


def converted(tmp_path):
    """A tiny random Llama, converted with --activations auto (`a`) and fp8 (`b`)."""
    from vllm_kbit.convert import main
    from vllm_kbit.synthetic import make_random_llama
    src = make_random_llama(tmp_path / "src", hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                            num_kv_heads=2, vocab_size=320, seed=1)

    def qc(d):
        return json.loads((d / "config.json").read_text())["quantization_config"]
    assert main([str(src), str(tmp_path / "a"), "--bits", "4", "--device", "cpu"]) == 0
    assert qc(tmp_path / "a")["activations"] == "auto"
    assert main([str(src), str(tmp_path / "b"), "--bits", "4", "--device", "cpu", "--activations", "fp8"]) == 0
    assert qc(tmp_path / "b")["activations"] == "fp8"
    return src


def test_convert_writes_the_activations_field(tmp_path, capsys):
    from vllm_kbit.convert import ConversionError, convert, main
    src = converted(tmp_path)
    assert main([str(src), str(tmp_path / "c"), "--bits", "4", "--activations", "int8"]) != 0
    assert "argument --activations: invalid choice: 'int8'" in capsys.readouterr().err
    with pytest.raises(ConversionError, match="activations must be one of 'auto', 'fp8', got 'e4m3'"):
        convert(src, tmp_path / "c", 4, device="cpu", activations="e4m3")
    assert not (tmp_path / "c").exists()


def test_check_reports_a_models_setting(tmp_path, monkeypatch):
    import io

    from vllm_kbit import check
    converted(tmp_path)
    assert check.model_line(str(tmp_path / "b")) == (f"model {tmp_path / 'b'}: kbit K=4, activations fp8", None)
    assert check.model_line(str(tmp_path / "a"))[0].endswith("kbit K=4, activations auto")
    line, problem = check.model_line(str(tmp_path / "src"))
    assert "not a kbit checkpoint" in line and problem
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    cfg["quantization_config"]["activations"] = "int8"
    (tmp_path / "b" / "config.json").write_text(json.dumps(cfg))
    line, problem = check.model_line(str(tmp_path / "b"))
    assert "quantization_config.activations must be one of 'auto', 'fp8', got 'int8'" in problem
    monkeypatch.setattr(check, "_vllm_sees_kbit", lambda: (True, "fake"))
    out = io.StringIO()
    assert check.run(out, model=str(tmp_path / "a")) == 0 and "activations auto" in out.getvalue()
    assert check.run(io.StringIO(), model=str(tmp_path / "b")) == 1


@pytest.mark.parametrize("why", [None, "this vllm_kbit has no FP8 kernel"])
def test_check_says_what_fp8_layers_run(why, monkeypatch):
    from vllm_kbit import check
    monkeypatch.setattr(fp8, "unavailable_reason", lambda: why)
    line = check.fp8_line()
    assert line.startswith("FP8 activations (")
    assert (f"16-bit activations instead: {why}" in line) if why else ("above 16 tokens" in line)


pytest.importorskip("vllm")

import vllm_kbit  # noqa: E402

vllm_kbit.register()

from vllm_kbit.config import ACTIVATIONS_OVERRIDE, KbitConfig  # noqa: E402


def _vllm_config_with(hf_config):
    return mock.Mock(model_config=mock.Mock(hf_config=hf_config))


def test_config_field_and_errors():
    base = {"quant_method": "kbit", "bits": 4}
    assert KbitConfig.from_config(base).activations == "auto"  # checkpoints without the field
    assert KbitConfig.from_config({**base, "activations": "fp8"}).activations == "fp8"
    assert KbitConfig().activations == "auto"
    with pytest.raises(ValueError, match=r"quantization_config\.activations must be one of"):
        KbitConfig.from_config({**base, "activations": "float8"})
    assert "activations='fp8'" in repr(KbitConfig.from_config({**base, "activations": "fp8"}))


def test_hf_overrides_reach_the_config(tmp_path):
    """`--hf-overrides '{"kbit_activations": "fp8"}'`: vLLM's get_config applies a flat override
    onto the model's hf_config (a dict-valued one such as quantization_config would replace the
    checkpoint's whole dict); the layers read it there, over quantization_config."""
    from vllm.transformers_utils.config import get_config
    src = converted(tmp_path)
    hf = get_config(str(tmp_path / "a"), trust_remote_code=False, hf_overrides_kw={ACTIVATIONS_OVERRIDE: "fp8"})
    assert getattr(hf, ACTIVATIONS_OVERRIDE) == "fp8"
    cfg = KbitConfig.from_config(hf.quantization_config)  # the checkpoint's own config is intact
    assert cfg.activations == "auto" and cfg.bits == 4
    with mock.patch("vllm_kbit.config.get_current_vllm_config_or_none", return_value=_vllm_config_with(hf)):
        assert cfg.serving_activations() == "fp8"
        assert KbitConfig().serving_activations() == "fp8"  # --quantization kbit on a float model
    plain = get_config(str(src), trust_remote_code=False)
    with mock.patch("vllm_kbit.config.get_current_vllm_config_or_none", return_value=_vllm_config_with(plain)):
        assert KbitConfig.from_config({"quant_method": "kbit", "bits": 4, "activations": "fp8"}).serving_activations() == "fp8"
        assert KbitConfig().serving_activations() == "auto"
    bad = get_config(str(tmp_path / "b"), trust_remote_code=False, hf_overrides_kw={ACTIVATIONS_OVERRIDE: "FP8"})
    with mock.patch("vllm_kbit.config.get_current_vllm_config_or_none", return_value=_vllm_config_with(bad)), \
         pytest.raises(ValueError, match="--hf-overrides kbit_activations must be one of 'auto', 'fp8'"):
        KbitConfig.from_config(bad.quantization_config).serving_activations()
    with mock.patch("vllm_kbit.config.get_current_vllm_config_or_none", return_value=None):
        assert KbitConfig.from_config(bad.quantization_config).serving_activations() == "fp8"


def test_vllm_replaces_a_dict_valued_override_whole(tmp_path):
    """Why the serve-time key is top-level: vLLM's ModelConfig sets a dict-valued hf_override
    (quantization_config is a plain dict in hf_config) in place of the checkpoint's, so a
    partial quantization_config would drop bits and codebook."""
    from vllm.config import ModelConfig
    from vllm.transformers_utils.config import get_config
    converted(tmp_path)
    hf = get_config(str(tmp_path / "a"), trust_remote_code=False)
    ModelConfig._apply_dict_overrides(mock.Mock(), hf, {"quantization_config": {"activations": "fp8"}})
    assert hf.quantization_config == {"activations": "fp8"}


# ----------------------------------------------------------------------------- vLLM layers on the CPU

@pytest.mark.usefixtures("vllm_single_process")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "row"])
def test_layer_with_fp8_activations_computes_the_reference(kind, bits, dtype):
    """On the CPU the layer runs the reference itself (equal bits); on a GPU with the FP8 kernel,
    the kernel within fp32-accumulation error and one output rounding of it."""
    from test_vllm_layers import DEVICE, build, forward, make_config, shards_for
    if DEVICE == "cuda" and not fp8.kernel_available():
        pytest.skip(f"no FP8 kernel here: {fp8.unavailable_reason()}")
    gen = torch.Generator().manual_seed(zlib.crc32(f"fp8-layer-{kind}-{bits}".encode()))
    shards = shards_for(kind, bits, gen)
    cb = kf.normal_float_codebook(bits)
    layer = build(kind, bits, dtype, shards, cfg=make_config(bits, activations="fp8"))
    plain = build(kind, bits, dtype, shards)
    assert layer.kbit_fp8 and not plain.kbit_fp8
    q = torch.cat([s[0] for s in shards.values()])
    a = torch.cat([s[1] for s in shards.values()])
    assert layer.kbit_w_exp == fp8.weight_exponent(a)  # one exponent for the fused layer
    n, k = q.shape[0], a.shape[1] * 32
    for m in (40, 5):
        x = torch.randn(m, k, generator=gen).to(dtype)
        y = forward(layer, x)
        if m <= fp8.GEMV_MAX_M:
            assert torch.equal(y, forward(plain, x)), m
            continue
        want = fp8.gemm_fp8_reference(x, q, a, cb, bits, n, k, layer.kbit_w_exp)
        assert y.dtype == dtype and torch.isfinite(y).all()
        if DEVICE == "cpu":
            assert torch.equal(y, want), m
        else:
            bound = torch.finfo(dtype).eps * want.double().abs() + 1e-4 * want.double().abs().mean()
            assert ((y.double() - want.double()).abs() <= bound).all(), m
    x = torch.randn(40, k, generator=gen).to(dtype)
    assert not torch.equal(forward(layer, x), forward(plain, x))


@pytest.mark.usefixtures("vllm_single_process")
def test_layer_without_the_fp8_kernel_runs_16_bit_activations():
    """A GPU build without the FP8 kernel cannot run the reference on its kernels' layout: the
    layer multiplies 16-bit activations and says so once."""
    from test_vllm_layers import build, make_config, shards_for
    gen = torch.Generator().manual_seed(9)
    shards = shards_for("row", 4, gen)
    with mock.patch("vllm_kbit.fp8.unavailable_reason", return_value="this vllm_kbit has no FP8 kernel"), \
         mock.patch("vllm_kbit.linear.logger.warning_once") as warn:
        layer = build("row", 4, torch.float16, shards, cfg=make_config(4, activations="fp8"))
    assert not layer.kbit_fp8 and not hasattr(layer, "kbit_w_exp")
    assert "no FP8 kernel" in warn.call_args[0][1]


def test_online_and_dummy_configs_accept_the_override():
    """`--quantization kbit` and `--load-format dummy` build KbitConfig() with no fields: the
    serve-time override alone turns FP8 on, at every K."""
    hf = mock.Mock(spec=[])
    setattr(hf, ACTIVATIONS_OVERRIDE, "fp8")
    with mock.patch("vllm_kbit.config.get_current_vllm_config_or_none", return_value=_vllm_config_with(hf)):
        for bits in kf.SUPPORTED_BITS:
            assert KbitConfig(bits=bits).serving_activations() == "fp8"


def test_the_quality_benchmark_simulates_the_same_function():
    """benchmarks/quality.py --fp8 runs fp8.linear on a weight decoded once, accumulating in
    float32: the reference's function up to the accumulation order."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("quality", Path(__file__).resolve().parents[1] / "benchmarks" / "quality.py")
    quality = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quality)
    gen = torch.Generator().manual_seed(21)
    w = torch.randn(64, 96, generator=gen) * 0.05
    bias = torch.randn(64, generator=gen)
    cb = default_codebook(4)
    x = torch.randn(33, 96, generator=gen)
    y = quality.kbit_fp8_forward(w, 4, cb, "rtn", bias)(x)
    q, a = kf.quantize(w, 4, cb)
    want = fp8.gemm_fp8_reference(x.double(), q, a, cb, 4, 64, 96, fp8.weight_exponent(a), bias)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    # W8A8: per-channel e4m3 weights; its error is e4m3's, a few %
    exact = x.double() @ w.double().t() + bias.double()
    err = ((quality.w8a8_forward(w, bias)(x).double() - exact).norm() / exact.norm()).item()
    assert 1e-3 < err < 0.06 and math.isfinite(err)
