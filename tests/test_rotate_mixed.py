"""Rotations folded into the checkpoint (quant/rotate.py, convert --rotate) and K per layer
(quant/mixed.py, convert --bits 2.5, the loader's bits_per_layer), on tiny random models (CPU).

Inputs are fresh random models; set KBIT_TEST_SEED to replay a run."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm_kbit import format as kf
from vllm_kbit.convert import ConversionError, convert, main
from vllm_kbit.quant import mixed, rotate, rounding
from vllm_kbit.quant.codebooks import default_codebook
from vllm_kbit.synthetic import make_random_model

SEED = int(os.environ.get("KBIT_TEST_SEED", random.SystemRandom().randrange(2**31)))


def _load(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _model(tmp_path: Path, arch: str, tie: bool, scalar_final_gain: bool = False, hidden: int = 192,
           **kw) -> Path:
    """A random fp32 model whose norm gains are random too (folding them is what is tested)."""
    import transformers

    src = make_random_model(tmp_path / f"{arch}-src", arch=arch, hidden_size=hidden, intermediate_size=256,
                            num_layers=2, num_heads=6 if hidden % 6 == 0 else 4, num_kv_heads=2, vocab_size=320,
                            dtype=torch.float32,
                            tie_word_embeddings=tie, seed=SEED, init_std=0.05, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
        if scalar_final_gain:
            model.model.norm.weight.fill_(1.7)
    model.save_pretrained(src)
    return src


def _logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits.double()


@pytest.mark.parametrize("n", [64, 576, 192, 12, 1])
def test_random_hadamard_is_orthogonal_and_spreads_a_spike(n):
    q = rotate.random_hadamard(n, torch.Generator().manual_seed(SEED))
    assert torch.allclose(q @ q.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    if n >= 64:  # a one-hot row is spread: no entry keeps more than a few times 1/sqrt(n)
        assert q.abs().max() < 4 / n ** 0.5


@pytest.mark.parametrize("arch,tie,scalar", [("llama", False, False), ("qwen3", True, False),
                                              ("qwen3", True, True), ("qwen2", False, False),
                                              ("mistral", False, False)])
def test_rotated_checkpoint_computes_the_same_logits(arch, tie, scalar, tmp_path):
    """The rotated float model's logits equal the original's (fp32: ~1e-6 relative), while its
    weights differ entirely; a tied pair stays tied when the final gain is a scalar and is
    untied otherwise (the only exact choice)."""
    src = _model(tmp_path, arch, tie, scalar)
    dst = rotate.rotate_checkpoint(src, tmp_path / "rot", seed=SEED % 1000, progress=False)
    ids = torch.randint(3, 300, (2, 33), generator=torch.Generator().manual_seed(SEED))
    a, b = _logits(src, ids), _logits(dst, ids)
    rel = ((a - b).norm() / a.norm()).item()
    assert rel < 1e-4, rel
    s, r = _load(src), _load(dst)
    w = "model.layers.0.mlp.down_proj.weight"
    assert (s[w] - r[w]).norm() > 0.5 * s[w].norm(), "the weights were not rotated"
    assert torch.all(r["model.layers.1.input_layernorm.weight"] == 1)
    cfg = json.loads((dst / "config.json").read_text())
    keeps_tie = tie and scalar
    assert cfg.get("tie_word_embeddings", False) == keeps_tie
    assert ("lm_head.weight" in r) == (not keeps_tie)


def test_rotation_and_then_quantization_stays_close(tmp_path):
    """convert --rotate: an ordinary kbit checkpoint of the rotated weights (same tensor names
    and shapes as without it), whose dequantization computes close to the source."""
    from e2e_common import dequantized_copy

    src = _model(tmp_path, "llama", False)
    rep = convert(src, tmp_path / "kbit", 4, progress=False, rotate=True, rotate_seed=3)
    plain = convert(src, tmp_path / "plain", 4, progress=False)
    assert rep.rotated and rep.src == str(src)
    a, b = _load(tmp_path / "kbit"), _load(tmp_path / "plain")
    assert {n: t.shape for n, t in a.items()} == {n: t.shape for n, t in b.items()}
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.qweight"], b["model.layers.0.self_attn.q_proj.qweight"])
    assert not list(tmp_path.glob(".kbit*")) and not list(tmp_path.glob(".*rotated*")), "temporary copy left"
    ids = torch.randint(3, 300, (2, 33), generator=torch.Generator().manual_seed(SEED))
    ref = _logits(src, ids)
    got = _logits(dequantized_copy(tmp_path / "kbit", tmp_path / "deq"), ids)
    rel = ((ref - got).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.5, rel


@pytest.mark.parametrize("arch,why", [("gemma2", "post-norms"), ("phi3", "fused qkv_proj")])
def test_rotation_refuses_architectures_it_cannot_fold(arch, why, tmp_path):
    src = make_random_model(tmp_path / "src", arch=arch, hidden_size=64, intermediate_size=128, num_layers=1,
                            num_heads=4, num_kv_heads=2, vocab_size=320)
    with pytest.raises(ConversionError, match=why):
        convert(src, tmp_path / "out", 4, progress=False, rotate=True)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    with pytest.raises(rotate.RotationError, match="LayerNorm subtracts the mean"):
        rotate.check_rotatable({"model_type": "gpt2"})
    with pytest.raises(rotate.RotationError, match="not one whose folding"):
        rotate.check_rotatable({"model_type": "kbit_unknown"})


def test_rotation_refuses_an_unknown_tensor_naming_it(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4}
    rot = rotate.Rotator(cfg, {"model.norm.weight": torch.ones(64)})
    with pytest.raises(rotate.RotationError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        rot.rotate("model.layers.0.mlp.extra.weight", torch.zeros(64, 64))


# ----------------------------------------------------------------------------- mixed K

def _groups(losses: dict[str, dict[int, float]], n: int = 1024) -> dict[str, dict]:
    return {g: {"members": [g], "weights": n, "loss": l} for g, l in losses.items()}


def test_allocation_meets_the_budget_and_upgrades_the_sensitive_layers():
    gen = torch.Generator().manual_seed(SEED)
    losses = {}
    for i in range(12):  # loss falls ~4x per bit; layer sensitivity spans two decades
        s = float(10 ** (2 * torch.rand((), generator=gen)))
        losses[f"l{i}"] = {k: s * 4.0 ** -k for k in mixed.CANDIDATES}
    groups = _groups(losses)
    for avg in (2.0, 2.5, 3.25, 3.5, 5.0):
        ks = mixed.allocate(groups, avg)
        got = mixed.average_bits(groups, ks)
        assert got <= avg + 1e-9 and got > avg - 1.0 / len(groups) - 1e-9, (avg, got, ks)
        order = sorted(losses, key=lambda g: losses[g][2])
        assert [ks[g] for g in order] == sorted(ks[g] for g in order), "a more sensitive layer got fewer bits"
    assert set(mixed.allocate(groups, 2.0).values()) == {2}
    assert set(mixed.allocate(groups, 5.0).values()) == {5}
    with pytest.raises(mixed.MixedBitsError, match=r"\[2, 5\]"):
        mixed.allocate(groups, 1.5)


def test_group_loss_falls_with_k_and_follows_the_inputs():
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(64, 128, generator=gen)
    x = torch.randn(512, 128, generator=gen)
    x[:, :8] *= 20  # a few loud input channels: the loss must weigh them
    h = x.T @ x
    losses = [mixed.group_loss([w], h, k) for k in mixed.CANDIDATES]
    assert all(a > b for a, b in zip(losses, losses[1:])), losses
    q, a = kf.quantize(w, 2, default_codebook(2))
    d = kf.dequantize(q, a, 2, default_codebook(2)) - w
    direct = ((x @ d.T).pow(2).sum() / (x @ w.T).pow(2).sum()).item()
    rtn = mixed.group_loss([w], h, 2, method="rtn")
    assert rtn == pytest.approx(direct, rel=1e-3)  # the same rounding: the same loss
    assert losses[0] < rtn  # mse's scale search only lowers the error


def test_group_loss_gptq_is_the_loss_gptq_leaves():
    gen = torch.Generator().manual_seed(SEED)
    ws = [torch.randn(48, 128, generator=gen), torch.randn(16, 128, generator=gen)]
    x = torch.randn(1024, 128, generator=gen) @ torch.randn(128, 128, generator=gen)  # correlated inputs
    h = x.T @ x
    for k in (2, 3):
        cb = default_codebook(k)
        got = mixed.group_loss(ws, h, k, method="gptq")
        num = den = 0.0
        for w in ws:
            q, a = rounding.quantize_gptq(w, h, k, cb)
            d = kf.dequantize(q, a, k, cb) - w
            num += (x @ d.T).double().pow(2).sum().item()
            den += (x @ w.T).double().pow(2).sum().item()
        assert got == pytest.approx(num / den, rel=1e-3)
        # gptq lowers the output error below mse rounding on correlated inputs
        assert got < 0.9 * mixed.group_loss(ws, h, k, method="mse")


def _calib_text(path: Path) -> Path:
    gen = random.Random(SEED)
    words = ("the quick brown fox jumps over lazy dog matrix attention token weight block scale "
             "codebook quantization layer model language time village sea morning evening").split()
    path.write_text(" ".join(gen.choice(words) for _ in range(4000)))
    return path


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_convert_mixed_bits_records_k_per_layer(method, tmp_path):
    """--bits 2.5: each quantized layer stored with its own K (fused q/k/v and gate/up sharing
    one), the average within the budget, bits_per_layer and each K's codebook in the config,
    and every stored tensor exactly what that K's quantizer gives."""
    from e2e_common import dequantized_copy

    src = _model(tmp_path, "llama", False, hidden=128)
    calib = _calib_text(tmp_path / "calib.txt")
    rep = convert(src, tmp_path / "kbit", 2.5, progress=False, method=method, calib=str(calib), calib_samples=2)
    qc = json.loads((tmp_path / "kbit" / "config.json").read_text())["quantization_config"]
    bpl = qc["bits_per_layer"]
    assert set(bpl) == {n[:-len(".weight")] for n in rep.quantized} and bpl == rep.bits_per_layer
    for i in range(2):
        p = f"model.layers.{i}"
        assert bpl[f"{p}.self_attn.q_proj"] == bpl[f"{p}.self_attn.k_proj"] == bpl[f"{p}.self_attn.v_proj"]
        assert bpl[f"{p}.mlp.gate_proj"] == bpl[f"{p}.mlp.up_proj"]
    assert len(set(bpl.values())) > 1, "2.5 on average needs more than one K"
    src_t, out_t = _load(src), _load(tmp_path / "kbit")
    n = {m: src_t[f"{m}.weight"].numel() for m in bpl}
    stored = sum(out_t[f"{m}.qweight"].numel() * 4 + out_t[f"{m}.absmax"].numel() for m in bpl)
    assert stored <= sum(mixed.stored_bytes(n[m], 2.5) for m in bpl)
    assert stored > sum(mixed.stored_bytes(n[m], 2.0) for m in bpl)
    for m, k in bpl.items():
        cb = torch.tensor(qc["codebooks"][str(k)])
        assert torch.equal(cb, default_codebook(k))
        assert out_t[f"{m}.qweight"].shape[1] == src_t[f"{m}.weight"].shape[1] // 32 * k
        if method == "rtn":
            q, a = kf.quantize(src_t[f"{m}.weight"], k, cb)
            assert torch.equal(out_t[f"{m}.qweight"], q) and torch.equal(out_t[f"{m}.absmax"], a), m
    deq = _load(dequantized_copy(tmp_path / "kbit", tmp_path / "deq"))
    w = "model.layers.0.mlp.down_proj.weight"
    assert kf.sqnr_db(src_t[w], deq[w].float()) > 4


def test_convert_mixed_bits_cli_and_refusals(tmp_path, capsys):
    src = _model(tmp_path, "llama", False, hidden=128)
    calib = _calib_text(tmp_path / "calib.txt")
    assert main([str(src), str(tmp_path / "out"), "--bits", "3.5", "--method", "rtn", "--calib", str(calib),
                 "--calib-samples", "2", "--rotate"]) == 0
    out = capsys.readouterr().out
    assert "mixed (average" in out and "rotated" in out
    assert main([str(src), str(tmp_path / "o2"), "--bits", "5.5"]) == 1
    assert "[2, 5]" in capsys.readouterr().err
    with pytest.raises(ConversionError, match="codebook"):
        convert(src, tmp_path / "o3", 2.5, codebook=[-1, 0, 0.5, 1], progress=False)


# ----------------------------------------------------------------------------- loader

def test_config_gives_each_layer_its_k_and_codebook():
    from vllm_kbit.config import KbitConfig

    qc = {"bits": 3, "codebook": default_codebook(3).tolist(),
          "codebooks": {str(k): default_codebook(k).tolist() for k in (2, 3, 4)},
          "bits_per_layer": {"model.layers.0.self_attn.q_proj": 4, "model.layers.0.self_attn.k_proj": 4,
                             "model.layers.0.self_attn.v_proj": 4, "model.layers.0.mlp.down_proj": 2,
                             "model.layers.1.self_attn.q_proj": 2, "model.layers.1.self_attn.k_proj": 4,
                             "model.layers.1.self_attn.v_proj": 4}}
    cfg = KbitConfig.from_config(qc)
    cfg.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    v = cfg.for_layer("model.layers.0.self_attn.qkv_proj")
    assert v.bits == 4 and torch.equal(v.codebook, default_codebook(4)) and cfg.bits == 3
    d = cfg.for_layer("model.layers.0.mlp.down_proj")
    assert d.bits == 2 and torch.equal(d.codebook, default_codebook(2))
    assert cfg.for_layer("model.layers.0.mlp.gate_up_proj") is cfg  # not listed: `bits`
    with pytest.raises(ValueError, match="different K"):
        cfg.for_layer("model.layers.1.self_attn.qkv_proj")
    bad = dict(qc, bits_per_layer={"model.layers.0.mlp.down_proj": 5})
    with pytest.raises(ValueError, match="no entry for K=5"):
        KbitConfig.from_config(bad)
    with pytest.raises(ValueError, match="must be an integer"):
        KbitConfig.from_config(dict(qc, bits_per_layer={"x": 2.5}))
