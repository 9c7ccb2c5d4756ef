"""The plugin inside vLLM's real linear layers: loading through vLLM's weight loaders, fused
QKV / gate_up shards, row-parallel, emulated tensor parallelism, ignore rules, clear errors.

Runs on the CPU (the op's reference path) and, unchanged, on a GPU with the CUDA kernels."""
import contextlib
import zlib
from unittest import mock

import pytest
import torch

pytest.importorskip("vllm")

import vllm_kbit  # noqa: E402
from vllm_kbit import format as kf  # noqa: E402
from vllm_kbit import ops  # noqa: E402

vllm_kbit.register()

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,  # noqa: E402
                                               RowParallelLinear, UnquantizedLinearMethod)
from vllm.model_executor.layers.quantization import get_quantization_config  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead  # noqa: E402
from transformers import LlamaConfig  # noqa: E402

from vllm_kbit.config import KbitConfig  # noqa: E402
from vllm_kbit.linear import KbitLinearMethod  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER, HEADS, KV_HEADS = 128, 192, 4, 2
HEAD = HIDDEN // HEADS
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


pytestmark = pytest.mark.usefixtures("vllm_single_process")


def make_config(bits, ignore=("lm_head",), codebook=None, **extra):
    cfg = KbitConfig.from_config({
        "quant_method": "kbit", "bits": bits, "block_size": 32, "absmax_format": "e4m4",
        "codebook": (kf.default_codebook(bits) if codebook is None else codebook).tolist(),
        "ignore": list(ignore), **extra})
    cfg.packed_modules_mapping = PACKED
    return cfg


@contextlib.contextmanager
def tensor_parallel(rank, size):
    """Build layers as rank `rank` of `size` in this one process: vLLM reads the rank when a
    layer and its parameters are created, and the loaders narrow the checkpoint with it."""
    with contextlib.ExitStack() as stack:
        for module in ("linear", "vocab_parallel_embedding"):
            for fn, value in (("rank", rank), ("world_size", size)):
                stack.enter_context(mock.patch(f"vllm.model_executor.layers.{module}.get_tensor_model_parallel_{fn}",
                                               return_value=value))
        for fn, value in (("rank", rank), ("world_size", size)):
            stack.enter_context(mock.patch(f"vllm.model_executor.parameter.get_tensor_model_parallel_{fn}",
                                           return_value=value))
        yield


def checkpoint(rows, cols, bits, gen, cb=None):
    """A random float weight and its kbit checkpoint tensors."""
    w = torch.randn(rows, cols, generator=gen) * 0.05
    q, a = kf.quantize(w, bits, cb)
    return q, a


def build(kind, bits, dtype, shards, tp=(0, 1), cfg=None):
    """A vLLM layer of `kind` loaded shard by shard through its weight loaders, as a model's
    load_weights does."""
    cfg = cfg or make_config(bits)
    torch.set_default_device(DEVICE)
    try:
        with tensor_parallel(*tp):
            if kind == "qkv":
                layer = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False, quant_config=cfg,
                                          prefix="model.layers.0.self_attn.qkv_proj", params_dtype=dtype)
            elif kind == "gate_up":
                layer = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], bias=False, quant_config=cfg,
                                                   prefix="model.layers.0.mlp.gate_up_proj", params_dtype=dtype)
            else:
                layer = RowParallelLinear(INTER, HIDDEN, bias=False, quant_config=cfg, reduce_results=False,
                                          prefix="model.layers.0.mlp.down_proj", params_dtype=dtype)
            for shard_id, (q, a) in shards.items():
                args = () if shard_id is None else (shard_id,)
                layer.qweight.weight_loader(layer.qweight, q, *args)
                layer.absmax.weight_loader(layer.absmax, a, *args)
            layer.quant_method.process_weights_after_loading(layer)
    finally:
        torch.set_default_device("cpu")
    return layer


def shards_for(kind, bits, gen):
    if kind == "qkv":
        return {"q": checkpoint(HEADS * HEAD, HIDDEN, bits, gen), "k": checkpoint(KV_HEADS * HEAD, HIDDEN, bits, gen),
                "v": checkpoint(KV_HEADS * HEAD, HIDDEN, bits, gen)}
    if kind == "gate_up":
        return {0: checkpoint(INTER, HIDDEN, bits, gen), 1: checkpoint(INTER, HIDDEN, bits, gen)}
    return {None: checkpoint(HIDDEN, INTER, bits, gen)}


def full_weight(shards, bits, cb=None):
    return torch.cat([kf.dequantize(q, a, bits, cb, dtype=torch.float64) for q, a in shards.values()])


def forward(layer, x):
    return layer(x.to(DEVICE))[0].cpu()


def rel_err(y, ref):
    return ((y.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "row"])
@pytest.mark.parametrize("m", [1, 5, 40])
def test_layer_equals_dequantized_reference(kind, bits, dtype, m):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}-{bits}-{m}".encode()))
    shards = shards_for(kind, bits, gen)
    layer = build(kind, bits, dtype, shards)
    assert isinstance(layer.quant_method, KbitLinearMethod)
    w = full_weight(shards, bits)
    x = torch.randn(m, w.shape[1], generator=gen).to(dtype)
    y = forward(layer, x)
    assert y.dtype == dtype and y.shape == (m, w.shape[0]) and torch.isfinite(y).all()
    assert rel_err(y, x.double() @ w.t()) < TOL[dtype]


@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
@pytest.mark.parametrize("m", [1, 40])
def test_layer_uses_the_checkpoint_codebook(bits, m):
    """A checkpoint's own codebook (config "codebook") reaches the layer's op, not the NF default."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"codebook-{bits}-{m}".encode()))
    cb = torch.sort(torch.rand(1 << bits, generator=gen) * 2 - 1).values
    cb[0], cb[-1] = -1.0, 1.0  # the block's absmax lands on an entry, as with NF
    shards = {None: checkpoint(HIDDEN, INTER, bits, gen, cb)}
    layer = build("row", bits, torch.bfloat16, shards, cfg=make_config(bits, codebook=cb))
    w = full_weight(shards, bits, cb)
    x = torch.randn(m, INTER, generator=gen).to(torch.bfloat16)
    assert rel_err(forward(layer, x), x.double() @ w.t()) < TOL[torch.bfloat16]


@pytest.mark.parametrize("kind", ["qkv", "gate_up", "row"])
def test_tensor_parallel_2_matches_tp_1(kind):
    bits, dtype = 4, torch.bfloat16
    gen = torch.Generator().manual_seed(7)
    shards = shards_for(kind, bits, gen)
    k = HIDDEN if kind != "row" else INTER
    x = torch.randn(6, k, generator=gen).to(dtype)
    y1 = forward(build(kind, bits, dtype, shards), x)
    ranks = [build(kind, bits, dtype, shards, tp=(r, 2)) for r in range(2)]
    if kind == "row":  # each rank sees its half of the input; partial outputs are summed
        parts = [forward(layer, x[:, r * k // 2:(r + 1) * k // 2]).double() for r, layer in enumerate(ranks)]
        y2 = (parts[0] + parts[1])
        assert rel_err(y1, y2) < 1e-2
        return
    outs = [forward(layer, x) for layer in ranks]
    sizes = ([HEADS * HEAD // 2, KV_HEADS * HEAD // 2, KV_HEADS * HEAD // 2] if kind == "qkv" else [INTER // 2] * 2)
    pieces = [o.split(sizes, dim=1) for o in outs]  # per rank: its slice of every fused shard
    y2 = torch.cat([pieces[r][s] for s in range(len(sizes)) for r in range(2)], dim=1)
    assert torch.equal(y1, y2)


VOCAB = 500  # vLLM pads it to 512 rows (64-row padding); at TP = 2 rank 1 holds 244 + 12 padding


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
@pytest.mark.parametrize("tp", [1, 2])
def test_quantized_lm_head(tp, bits, dtype):
    """quantization_config.lm_head = true: vLLM's ParallelLMHead loads the kbit tensors through
    its own vocab-sharding loader and LogitsProcessor's call (quant_method.apply) gives the
    logits of the dequantized weight; the padding rows vLLM adds give exactly 0."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"lm_head-{tp}-{bits}".encode()))
    q, a = checkpoint(VOCAB, HIDDEN, bits, gen)
    x = torch.randn(7, HIDDEN, generator=gen).to(dtype)
    w = kf.dequantize(q, a, bits, dtype=torch.float64)
    logits = []
    for rank in range(tp):
        torch.set_default_device(DEVICE)
        try:
            with tensor_parallel(rank, tp):
                head = ParallelLMHead(VOCAB, HIDDEN, params_dtype=dtype, quant_config=make_config(bits, ignore=(), lm_head=True),
                                      prefix="lm_head")
                assert isinstance(head.quant_method, KbitLinearMethod)
                head.qweight.weight_loader(head.qweight, q)
                head.absmax.weight_loader(head.absmax, a)
                head.quant_method.process_weights_after_loading(head)
        finally:
            torch.set_default_device("cpu")
        y = head.quant_method.apply(head, x.to(DEVICE)).cpu()
        assert y.dtype == dtype and y.shape == (7, 512 // tp) and torch.isfinite(y).all()
        logits.append(y)
    y = torch.cat(logits, dim=1)
    assert torch.equal(y[:, VOCAB:], torch.zeros_like(y[:, VOCAB:]))
    assert rel_err(y[:, :VOCAB], x.double() @ w.t()) < TOL[dtype]


def test_lm_head_stays_float_unless_asked():
    head = ParallelLMHead(VOCAB, HIDDEN, quant_config=make_config(4, ignore=()), prefix="lm_head")
    assert type(head.quant_method).__name__ == "UnquantizedEmbeddingMethod" and hasattr(head, "weight")
    with pytest.raises(ValueError, match="lm_head is true but 'lm_head' is in ignore"):
        make_config(4, ignore=("lm_head",), lm_head=True)
    with pytest.raises(ValueError, match="lm_head must be true or false"):
        make_config(4, ignore=(), lm_head="yes")
    tied = mock.Mock(model_config=mock.Mock(hf_config=LlamaConfig(tie_word_embeddings=True)))
    with mock.patch("vllm_kbit.config.get_current_vllm_config_or_none", return_value=tied), \
         pytest.raises(ValueError, match="lm_head is tied to the input embeddings"):
        ParallelLMHead(VOCAB, HIDDEN, quant_config=make_config(4, ignore=(), lm_head=True), prefix="lm_head")
    # models that tie whatever their config says (vLLM calls tie_weights on the quant method)
    head = ParallelLMHead(VOCAB, HIDDEN, quant_config=make_config(4, ignore=(), lm_head=True), prefix="lm_head")
    with pytest.raises(ValueError, match="lm_head is kbit .* ties it to the input embeddings"):
        head.tie_weights(torch.nn.Embedding(VOCAB, HIDDEN))
    # other heads vLLM builds as ParallelLMHead (multi-token prediction) stay float
    mtp = ParallelLMHead(VOCAB, HIDDEN, quant_config=make_config(4, ignore=(), lm_head=True),
                         prefix="model.layers.2.shared_head.head")
    assert type(mtp.quant_method).__name__ == "UnquantizedEmbeddingMethod"
    with pytest.raises(ValueError, match="lm_head is true but ignore matches lm_head"):
        ParallelLMHead(VOCAB, HIDDEN, quant_config=make_config(4, ignore=("re:.*head$",), lm_head=True), prefix="lm_head")


def test_ignored_layers_stay_unquantized():
    cfg = make_config(4, ignore=["lm_head", "re:.*self_attn\\.(q|k|v)_proj$", "model.layers.0.mlp.down_proj"])
    assert isinstance(cfg.get_quant_method(_linear_stub(), "model.layers.0.self_attn.qkv_proj"), UnquantizedLinearMethod)
    assert isinstance(cfg.get_quant_method(_linear_stub(), "model.layers.0.mlp.down_proj"), UnquantizedLinearMethod)
    assert isinstance(cfg.get_quant_method(_linear_stub(), "model.layers.1.mlp.down_proj"), KbitLinearMethod)
    assert isinstance(cfg.get_quant_method(_linear_stub(), "model.layers.0.mlp.gate_up_proj"), KbitLinearMethod)
    assert cfg.get_quant_method(torch.nn.Embedding(4, 4), "model.embed_tokens") is None


def _linear_stub():
    from vllm.model_executor.layers.linear import LinearBase
    return LinearBase.__new__(LinearBase)


def test_registered_and_config_errors():
    assert get_quantization_config("kbit") is KbitConfig
    with pytest.raises(ValueError, match="exactly 8"):
        KbitConfig.from_config({"quant_method": "kbit", "bits": 3, "codebook": [0.0, 0.5, 1.0]})
    with pytest.raises(ValueError, match="bits must be"):
        KbitConfig.from_config({"quant_method": "kbit", "bits": 6})
    with pytest.raises(ValueError, match="absmax_format"):
        KbitConfig.from_config({"quant_method": "kbit", "bits": 4, "absmax_format": "fp16"})


def test_checkpoint_errors_name_the_tensor():
    gen = torch.Generator().manual_seed(3)
    with pytest.raises(ValueError, match=r"down_proj\.qweight has shape .*bits=4"):  # a 3-bit checkpoint, 4-bit config
        build("row", 4, torch.bfloat16, {None: checkpoint(HIDDEN, INTER, 3, gen)})
    q, a = checkpoint(HIDDEN, INTER, 4, gen)
    with pytest.raises(ValueError, match=r"down_proj\.absmax must be torch.uint8"):
        build("row", 4, torch.bfloat16, {None: (q, a.to(torch.int32))})
    shards = shards_for("qkv", 4, gen)
    del shards["v"]
    with pytest.raises(ValueError, match=r"qkv_proj\.qweight is missing from the checkpoint"):
        build("qkv", 4, torch.bfloat16, shards)


def test_multi_shard_ids_count_every_shard():
    # some models load several shards of a merged layer in one call (shard id (0, 1))
    cfg = make_config(4)
    gen = torch.Generator().manual_seed(9)
    parts = [checkpoint(INTER, HIDDEN, 4, gen) for _ in range(3)]
    torch.set_default_device(DEVICE)
    try:
        layer = MergedColumnParallelLinear(HIDDEN, [INTER] * 3, bias=False, quant_config=cfg, params_dtype=torch.bfloat16,
                                           prefix="model.layers.0.mlp.in_proj")
        for ids, chunk in (((0, 1), parts[:2]), (2, parts[2:])):
            q, a = torch.cat([c[0] for c in chunk]), torch.cat([c[1] for c in chunk])
            layer.qweight.weight_loader(layer.qweight, q, ids)
            layer.absmax.weight_loader(layer.absmax, a, ids)
        layer.quant_method.process_weights_after_loading(layer)
    finally:
        torch.set_default_device("cpu")
    w = torch.cat([kf.dequantize(q, a, 4, dtype=torch.float64) for q, a in parts])
    x = torch.randn(3, HIDDEN, generator=gen).to(torch.bfloat16)
    assert rel_err(forward(layer, x), x.double() @ w.t()) < 1e-2


def test_tensor_parallel_split_must_keep_whole_blocks():
    cfg = make_config(4)
    with tensor_parallel(0, 2), pytest.raises(ValueError, match=r"o_proj: input size 96 split .* into 48"):
        RowParallelLinear(96, 64, bias=False, quant_config=cfg, reduce_results=False,
                          prefix="model.layers.0.self_attn.o_proj", params_dtype=torch.bfloat16)


@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
def test_op_bias_fake_and_compile(bits):
    gen = torch.Generator().manual_seed(bits)
    q, a = checkpoint(96, 64, bits, gen)
    cb = kf.default_codebook(bits)
    packed, absmax = ops.repack(q.to(DEVICE), a.to(DEVICE), bits)
    x = torch.randn(3, 7, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16).to(DEVICE)
    args = (packed, absmax, cb.to(DEVICE), bits, 96, 64, bias)
    y = ops.gemm(x, *args)
    ref = x.double().cpu() @ kf.dequantize(q, a, bits, cb, dtype=torch.float64).t() + bias.double().cpu()
    assert y.shape == (3, 7, 96) and rel_err(y.cpu(), ref) < 1e-2
    torch.library.opcheck(torch.ops.kbit.gemm.default, (x.reshape(-1, 64), *args),
                          test_utils=("test_schema", "test_faketensor"))
    compiled = torch.compile(lambda t: ops.gemm(t, *args), backend="aot_eager", dynamic=True, fullgraph=True)
    for m in (1, 5):
        xm = torch.randn(m, 64, generator=gen).to(torch.bfloat16).to(DEVICE)
        torch.testing.assert_close(compiled(xm), ops.gemm(xm, *args))


@pytest.mark.parametrize("kind", ["qkv", "row"])
def test_online_quantization_of_a_float_checkpoint(kind):
    """`--quantization kbit` on a model without a quantization_config: vLLM builds KbitConfig()
    (K=4), loads the float `weight` through its loaders and the plugin quantizes after loading."""
    cfg = KbitConfig()
    cfg.packed_modules_mapping = PACKED
    gen = torch.Generator().manual_seed(11)
    k = HIDDEN if kind != "row" else INTER
    parts = ({"q": HEADS * HEAD, "k": KV_HEADS * HEAD, "v": KV_HEADS * HEAD} if kind == "qkv" else {None: HIDDEN})
    floats = {s: torch.randn(rows, k, generator=gen) * 0.05 for s, rows in parts.items()}
    torch.set_default_device(DEVICE)
    try:
        layer = (QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False, quant_config=cfg, params_dtype=torch.bfloat16,
                                   prefix="model.layers.0.self_attn.qkv_proj") if kind == "qkv" else
                 RowParallelLinear(INTER, HIDDEN, bias=False, quant_config=cfg, reduce_results=False,
                                   params_dtype=torch.bfloat16, prefix="model.layers.0.mlp.down_proj"))
        for s, w in floats.items():
            layer.weight.weight_loader(layer.weight, w.to(torch.bfloat16), *(() if s is None else (s,)))
        layer.quant_method.process_weights_after_loading(layer)
    finally:
        torch.set_default_device("cpu")
    assert not hasattr(layer, "weight") and layer.qweight.dtype == torch.int32
    cb = cfg.codebook
    w_hat = torch.cat([kf.dequantize(*kf.quantize(w.to(torch.bfloat16), 4, cb), 4, cb, dtype=torch.float64)
                       for w in floats.values()])
    x = torch.randn(4, k, generator=gen).to(torch.bfloat16)
    assert rel_err(forward(layer, x), x.double() @ w_hat.t()) < 1e-2


def test_default_codebooks():
    """Every entry point that quantizes defaults to nf0 (format.quantize, ops.quantize, the
    converter, quantizing at load time); a checkpoint config without a codebook predates it and
    means NF; a stored codebook is read as stored."""
    from vllm_kbit.quant import default_codebook
    assert kf.DEFAULT_CODEBOOK == "nf0"
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)) * 0.05
    for bits in (2, 3, 4, 5):
        nf0 = kf.nf0_codebook(bits)
        assert torch.equal(default_codebook(bits), nf0) and torch.equal(kf.default_codebook(bits), nf0)
        assert torch.equal(KbitConfig(bits).codebook, nf0)
        want = kf.quantize(w, bits, nf0)
        for q, a in (kf.quantize(w, bits), ops.quantize(w.to(DEVICE), bits)[:2]):
            assert torch.equal(q.cpu(), want[0]) and torch.equal(a.cpu(), want[1]), bits
        assert torch.equal(KbitConfig.from_config({"bits": bits}).codebook, kf.normal_float_codebook(bits))
        stored = torch.linspace(-1, 1, 1 << bits)
        assert torch.equal(KbitConfig.from_config({"bits": bits, "codebook": stored.tolist()}).codebook, stored)
    assert not torch.equal(default_codebook(3), kf.normal_float_codebook(3))


def test_online_quantization_reports_a_missing_shard():
    cfg = KbitConfig()
    cfg.packed_modules_mapping = PACKED
    layer = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False, quant_config=cfg, params_dtype=torch.bfloat16,
                              prefix="model.layers.0.self_attn.qkv_proj")
    for s, rows in (("q", HEADS * HEAD), ("k", KV_HEADS * HEAD)):  # no v
        layer.weight.weight_loader(layer.weight, torch.randn(rows, HIDDEN).to(torch.bfloat16), s)
    with pytest.raises(ValueError, match=r"qkv_proj\.weight is missing from the checkpoint"):
        layer.quant_method.process_weights_after_loading(layer)


def test_dummy_load_fills_valid_kbit_weights():
    vc = VllmConfig()
    vc.load_config.load_format = "dummy"
    with set_current_vllm_config(vc):
        layer = build("gate_up", 3, torch.bfloat16, {})
    x = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    y = forward(layer, x)
    assert torch.isfinite(y).all() and y.abs().max() > 0
    # before the repack (the reference path keeps the checkpoint layout): every index of the
    # codebook appears at every position of a block, and the scales are in the dummy range
    if not ops.HAS_CUDA_KERNELS:
        idx = kf.unpack_bitplanes(layer.qweight.data.cpu(), 3).reshape(-1, 32).long()
        counts = torch.stack([torch.bincount(idx[:, i], minlength=8) for i in range(32)])
        assert (counts > 0).all(), "some block position never gets some codebook index"
        scale = kf.decode_e4m4(layer.absmax.data.cpu())
        assert 0.028 <= scale.min() and scale.max() <= 0.13


def _random_codebook(bits, gen):
    cb = torch.sort(torch.rand(1 << bits, generator=gen) * 1.8 - 0.9).values
    cb[0] = -1.0  # asymmetric: no NF-like codebook maps to it
    return cb


def build_with_codebooks(kind, bits, shards, codebooks):
    """`build`, with a per-layer codebook tensor loaded per shard as a model's load_weights
    routes `P.codebook` (the shard id of fused layers, none otherwise)."""
    cfg = make_config(bits, codebook_per_layer=True)
    torch.set_default_device(DEVICE)
    try:
        layer = {"qkv": lambda: QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False, quant_config=cfg,
                                                  prefix="model.layers.0.self_attn.qkv_proj",
                                                  params_dtype=torch.bfloat16),
                 "row": lambda: RowParallelLinear(INTER, HIDDEN, bias=False, quant_config=cfg, reduce_results=False,
                                                  prefix="model.layers.0.mlp.down_proj",
                                                  params_dtype=torch.bfloat16)}[kind]()
        for shard_id, (q, a) in shards.items():
            args = () if shard_id is None else (shard_id,)
            layer.qweight.weight_loader(layer.qweight, q, *args)
            layer.absmax.weight_loader(layer.absmax, a, *args)
            if shard_id in codebooks:
                layer.codebook.weight_loader(layer.codebook, codebooks[shard_id], *args)
        layer.quant_method.process_weights_after_loading(layer)
    finally:
        torch.set_default_device("cpu")
    return layer


@pytest.mark.parametrize("bits", kf.SUPPORTED_BITS)
@pytest.mark.parametrize("kind", ["qkv", "row"])
def test_per_layer_codebook_reaches_the_op(kind, bits):
    """quantization_config.codebook_per_layer: each layer computes with its own `codebook`
    tensor (shared by a fused layer's shards), not the config's."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"layer-cb-{kind}-{bits}".encode()))
    cb = _random_codebook(bits, gen)
    if kind == "qkv":
        shards = {s: checkpoint(r * HEAD, HIDDEN, bits, gen, cb) for s, r in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
    else:
        shards = {None: checkpoint(HIDDEN, INTER, bits, gen, cb)}
    layer = build_with_codebooks(kind, bits, shards, {s: cb.clone() for s in shards})
    assert not hasattr(layer, "codebook") and torch.equal(layer.kbit_codebook.cpu(), cb)
    w = full_weight(shards, bits, cb)
    x = torch.randn(9, w.shape[1], generator=gen).to(torch.bfloat16)
    y = forward(layer, x)
    assert rel_err(y, x.double() @ w.t()) < TOL[torch.bfloat16]
    assert rel_err(y, x.double() @ full_weight(shards, bits).t()) > 0.05  # the config's codebook would be far off


def test_per_layer_codebook_errors_name_the_layer():
    bits, gen = 3, torch.Generator().manual_seed(3)
    cb, other = _random_codebook(bits, gen), _random_codebook(bits, gen)
    shards = {s: checkpoint(r * HEAD, HIDDEN, bits, gen, cb) for s, r in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS))}
    with pytest.raises(ValueError, match=r"qkv_proj\.codebook: shard 'k' carries a codebook different"):
        build_with_codebooks("qkv", bits, shards, {"q": cb, "k": other, "v": cb})
    with pytest.raises(ValueError, match=r"qkv_proj\.codebook is missing from the checkpoint \(loaded shards: \['q', 'v'\]"):
        build_with_codebooks("qkv", bits, shards, {"q": cb, "v": cb})
    with pytest.raises(ValueError, match=r"qkv_proj\.codebook: codebook has 4 entries but bits=3"):
        build_with_codebooks("qkv", bits, shards, {"q": cb[:4]})
    with pytest.raises(ValueError, match="codebook_per_layer must be true or false"):
        make_config(bits, codebook_per_layer="yes")
