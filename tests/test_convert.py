"""HF -> kbit converter: tiny random Llamas (sharded safetensors) converted on the CPU.

Inputs are fresh random models; set KBIT_TEST_SEED to replay a run (a failing test's captured
output shows the seed)."""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from vllm_kbit import format as kf
from vllm_kbit.convert import (DEFAULT_IGNORE, DEFAULT_METHOD, INDEX_NAME, ROUTER_PATTERN, ConversionError, convert,
                               main, parse_size)
from vllm_kbit.format import KbitFormatError
from vllm_kbit.quant import default_codebook, quantize_weight
from vllm_kbit.synthetic import ARCHITECTURES, MOE_ARCHITECTURES, make_random_llama, make_random_model

from e2e_common import dequantized_copy

ROUTER_RE = re.compile(ROUTER_PATTERN[len("re:"):])

SEED = int(os.environ.get("KBIT_TEST_SEED", random.SystemRandom().randrange(2**31)))
LAYERS = 2
PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
LINEARS = [f"model.layers.{i}.{p}" for i in range(LAYERS) for p in PROJS]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")
# N(0, 0.02) weights give about 7.3 / 15 / 21 / 26 dB; the margin covers the smallest tensors.
MIN_SQNR_DB = {2: 5.5, 3: 12.5, 4: 18.5, 5: 23.5}


def _tiny_llama(dst: Path, seed: int, intermediate_size: int = 128) -> Path:
    return make_random_llama(dst, hidden_size=64, intermediate_size=intermediate_size, num_layers=LAYERS,
                             num_heads=4, num_kv_heads=2, vocab_size=320, seed=seed, max_shard_size="40KB")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    print(f"KBIT_TEST_SEED={SEED}")
    src = _tiny_llama(tmp_path_factory.mktemp("src") / "llama", SEED)
    assert len(json.loads((src / INDEX_NAME).read_text())["weight_map"]) > 0
    assert len(list(src.glob("*.safetensors"))) > 1, "the source must be sharded"
    return src


@pytest.fixture
def src_copy(llama, tmp_path) -> Path:
    """A private copy of the source model, for tests that edit it."""
    return Path(shutil.copytree(llama, tmp_path / "src"))


def load_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a sharded checkpoint, checking the index against the shards."""
    index = json.loads((folder / INDEX_NAME).read_text())
    weight_map = index["weight_map"]
    shards = sorted(set(weight_map.values()))
    assert sorted(p.name for p in folder.glob("*.safetensors")) == shards
    tensors = {}
    for shard in shards:
        with safe_open(str(folder / shard), framework="pt") as f:
            keys = set(f.keys())
            assert keys == {n for n, s in weight_map.items() if s == shard}, shard
            assert not keys & tensors.keys(), "a tensor in two shards"
            tensors.update({k: f.get_tensor(k) for k in keys})
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    return tensors


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def quant_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def assert_quantized(src_t, out_t, name, bits, codebook=None, method=DEFAULT_METHOD):
    """The stored tensors are, bit for bit, what `method` (convert's default unless told)
    writes with `codebook` (default: convert's default codebook)."""
    w = src_t[f"{name}.weight"]
    codebook = default_codebook(bits) if codebook is None else codebook
    n, k = w.shape
    q, a = out_t[f"{name}.qweight"], out_t[f"{name}.absmax"]
    assert f"{name}.weight" not in out_t
    assert q.dtype == torch.int32 and q.shape == (n, k // 32 * bits), name
    assert a.dtype == torch.uint8 and a.shape == (n, k // 32), name
    q_ref, a_ref = quantize_weight(w, bits, codebook, method)
    assert torch.equal(q, q_ref) and torch.equal(a, a_ref), name  # the stored tensors, bit for bit
    return kf.sqnr_db(w.float(), kf.dequantize(q, a, bits, codebook))


def assert_kept(src_t, out_t, name):
    assert same_bytes(src_t[f"{name}.weight"], out_t[f"{name}.weight"]), name
    assert f"{name}.qweight" not in out_t and f"{name}.absmax" not in out_t, name


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_convert_sharded_llama(llama, tmp_path, bits):
    dst = tmp_path / "kbit"
    report = convert(llama, dst, bits, max_shard_size="30KB", device="cpu", progress=False)
    src_t, out_t = load_checkpoint(llama), load_checkpoint(dst)
    assert len(list(dst.glob("*.safetensors"))) > 1

    assert sorted(report.quantized) == sorted(f"{m}.weight" for m in LINEARS)
    for m in LINEARS:
        assert assert_quantized(src_t, out_t, m, bits) > MIN_SQNR_DB[bits], m
    # Everything else (embeddings, norms, lm_head) byte for byte.
    rest = set(src_t) - {f"{m}.weight" for m in LINEARS}
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
            "model.layers.1.input_layernorm.weight"} <= rest
    assert set(out_t) == rest | {f"{m}.{s}" for m in LINEARS for s in ("qweight", "absmax")}
    for name in rest:
        assert same_bytes(src_t[name], out_t[name]), name
    assert report.skipped == {"lm_head.weight": "ignored (matches 'lm_head')"}

    config = json.loads((dst / "config.json").read_text())
    qc = config.pop("quantization_config")
    assert config == json.loads((llama / "config.json").read_text())
    assert (qc["quant_method"], qc["bits"], qc["block_size"], qc["absmax_format"]) == ("kbit", bits, 32, "e4m4")
    assert torch.equal(torch.tensor(qc["codebook"], dtype=torch.float32), default_codebook(bits))
    assert "lm_head" in qc["ignore"] and qc["ignore"] == report.ignore and "lm_head" not in qc
    for f in TOKENIZER_FILES:
        assert (dst / f).read_bytes() == (llama / f).read_bytes(), f
    assert sorted(report.copied_files) == sorted(TOKENIZER_FILES)
    assert report.bytes_in == sum(t.numel() * t.element_size() for t in src_t.values())
    assert report.bytes_out == json.loads((dst / INDEX_NAME).read_text())["metadata"]["total_size"]
    assert report.bytes_out < report.bytes_in
    assert os.listdir(tmp_path) == ["kbit"]


def test_output_loads_with_transformers_tokenizer(llama, tmp_path):
    from transformers import AutoTokenizer

    dst = tmp_path / "kbit"
    convert(llama, dst, 4, progress=False)
    text = "The quick brown fox, step 42."
    assert AutoTokenizer.from_pretrained(dst)(text).input_ids == AutoTokenizer.from_pretrained(llama)(text).input_ids


def rewrite_weight(src: Path, name: str, edit) -> None:
    """Apply `edit` to a clone of tensor `name` and save it back into its shard of `src`."""
    shard = src / json.loads((src / INDEX_NAME).read_text())["weight_map"][name]
    tensors = load_file(shard)
    tensors[name] = tensors[name].clone()
    edit(tensors[name])
    save_file(tensors, str(shard), metadata={"format": "pt"})


@pytest.mark.parametrize("poison", ["nan", "inf", "huge"])
def test_bad_weight_fails_naming_tensor_and_leaves_nothing(src_copy, tmp_path, poison, capsys):
    rng = random.Random(SEED)
    name = f"{rng.choice(LINEARS)}.weight"

    def poison_one(w):
        w[rng.randrange(w.shape[0]), rng.randrange(w.shape[1])] = {"nan": float("nan"), "inf": float("-inf"),
                                                                  "huge": 2 * kf.E4M4_MAX}[poison]
    rewrite_weight(src_copy, name, poison_one)

    before = sorted(os.listdir(tmp_path))
    with pytest.raises(KbitFormatError, match=re.escape(name)):
        convert(src_copy, tmp_path / "out", 4, progress=False)
    assert sorted(os.listdir(tmp_path)) == before  # no DST, no temp folder

    # With --overwrite, a failed conversion leaves the existing DST as it was.
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("previous")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(KbitFormatError, match=re.escape(name)):
        convert(src_copy, dst, 4, overwrite=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == before
    assert os.listdir(dst) == ["old.txt"] and (dst / "old.txt").read_text() == "previous"

    capsys.readouterr()
    assert main([str(src_copy), str(tmp_path / "cli"), "--bits", "3"]) != 0
    assert name in capsys.readouterr().err  # the CLI names the tensor too
    assert not (tmp_path / "cli").exists()


def test_dst_that_would_replace_src_is_refused(src_copy, tmp_path):
    before = sorted(os.listdir(src_copy))
    for dst in (src_copy, tmp_path):  # SRC itself, or a folder holding it
        with pytest.raises(ConversionError, match="would replace SRC"):
            convert(src_copy, dst, 4, overwrite=True, progress=False)
    assert sorted(os.listdir(src_copy)) == before


def test_existing_dst_needs_overwrite(llama, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old.txt").write_text("previous")
    with pytest.raises(ConversionError, match="use overwrite=True to replace it"):
        convert(llama, dst, 4, progress=False)
    assert os.listdir(dst) == ["old.txt"]

    convert(llama, dst, 4, overwrite=True, progress=False)
    assert not (dst / "old.txt").exists()
    assert quant_config(dst)["bits"] == 4
    load_checkpoint(dst)
    assert os.listdir(tmp_path) == ["out"]  # the replaced DST and the temp folder are gone


def test_ignore_exact_and_regex(llama, tmp_path):
    exact = "model.layers.0.self_attn.o_proj"
    regex = r"re:model\.layers\.1\.mlp\..*"
    report = convert(llama, tmp_path / "out", 3, ignore=[exact, regex], progress=False)
    src_t, out_t = load_checkpoint(llama), load_checkpoint(tmp_path / "out")
    ignored = {exact} | {f"model.layers.1.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}
    for m in LINEARS:
        if m in ignored:
            assert_kept(src_t, out_t, m)
            assert f"{m}.weight" in report.skipped
        else:
            assert_quantized(src_t, out_t, m, 3)
    assert sorted(report.quantized) == sorted(f"{m}.weight" for m in set(LINEARS) - ignored)
    ignore = quant_config(tmp_path / "out")["ignore"]
    assert {"lm_head", exact, regex} <= set(ignore)


def test_quantize_lm_head_via_cli(llama, tmp_path):
    dst = tmp_path / "out"
    assert main([str(llama), str(dst), "--bits", "4", "--quantize-lm-head", "--device", "cpu"]) == 0
    src_t, out_t = load_checkpoint(llama), load_checkpoint(dst)
    for m in [*LINEARS, "lm_head"]:
        assert assert_quantized(src_t, out_t, m, 4) > MIN_SQNR_DB[4], m
    assert same_bytes(src_t["model.embed_tokens.weight"], out_t["model.embed_tokens.weight"])
    qc = quant_config(dst)
    assert qc["lm_head"] is True and "lm_head" not in qc["ignore"]


def test_quantize_lm_head_refused_when_tied_or_ignored(llama, tmp_path):
    tied = make_random_llama(tmp_path / "tied", hidden_size=64, intermediate_size=128, num_layers=1,
                             num_heads=4, num_kv_heads=2, vocab_size=320, tie_word_embeddings=True)
    with pytest.raises(ConversionError, match="ties lm_head to its input embeddings"):
        convert(tied, tmp_path / "out", 4, quantize_lm_head=True, progress=False)
    with pytest.raises(ConversionError, match=r"lm_head stays unquantized \(ignored"):
        convert(llama, tmp_path / "out", 4, ignore=["lm_head"], quantize_lm_head=True, progress=False)
    assert sorted(os.listdir(tmp_path)) == ["tied"]
    convert(tied, tmp_path / "out", 4, progress=False)  # tied, lm_head left alone: fine
    assert "lm_head" not in quant_config(tmp_path / "out")


def test_partial_ignore_of_a_fused_group_is_refused(llama, tmp_path):
    # vLLM loads q/k/v into one qkv_proj layer: half-quantized, it could not load the checkpoint
    with pytest.raises(ConversionError, match=r"model\.layers\.0\.self_attn\.q_proj would stay unquantized but "
                       r"model\.layers\.0\.self_attn\.k_proj, model\.layers\.0\.self_attn\.v_proj would not"):
        convert(llama, tmp_path / "out", 4, ignore=["model.layers.0.self_attn.q_proj"], progress=False)
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConversionError, match=r"model\.layers\.1\.mlp\.up_proj would stay unquantized but "
                       r"model\.layers\.1\.mlp\.gate_proj would not"):
        convert(llama, tmp_path / "out", 4, ignore=["model.layers.1.mlp.up_proj"], progress=False)
    assert not (tmp_path / "out").exists()
    group = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    report = convert(llama, tmp_path / "out", 4, ignore=group, progress=False)
    assert all(f"{m}.weight" in report.skipped for m in group)


def test_in_features_not_multiple_of_32_left_unquantized(tmp_path, capsys):
    # intermediate 80: gate/up are [80, 64] (quantizable), down_proj is [64, 80] (K = 80).
    src = _tiny_llama(tmp_path / "src", SEED + 1, intermediate_size=80)
    report = convert(src, tmp_path / "out", 4, progress=False)
    src_t, out_t = load_checkpoint(src), load_checkpoint(tmp_path / "out")
    ignore = quant_config(tmp_path / "out")["ignore"]
    err = capsys.readouterr().err
    for m in LINEARS:
        if m.endswith("down_proj"):
            assert_kept(src_t, out_t, m)
            assert m in ignore
            assert "multiple of 32" in report.skipped[f"{m}.weight"]
            assert m in err
        else:
            assert_quantized(src_t, out_t, m, 4)


def test_custom_codebook_via_cli(llama, tmp_path):
    bits = 2
    cb = torch.sort(torch.rand(1 << bits, generator=torch.Generator().manual_seed(SEED)) * 2 - 1).values
    (tmp_path / "cb.json").write_text(json.dumps(cb.tolist()))
    dst = tmp_path / "out"
    rc = main([str(llama), str(dst), "--bits", str(bits), "--codebook", str(tmp_path / "cb.json"),
               "--ignore", r"re:.*\.o_proj$", "--max-shard-size", "20KB", "--device", "cpu"])
    assert rc == 0
    qc = quant_config(dst)
    assert torch.equal(torch.tensor(qc["codebook"], dtype=torch.float32), cb)
    assert r"re:.*\.o_proj$" in qc["ignore"]
    src_t, out_t = load_checkpoint(llama), load_checkpoint(dst)
    for m in LINEARS:
        if m.endswith("o_proj"):
            assert_kept(src_t, out_t, m)
        else:
            assert_quantized(src_t, out_t, m, bits, cb)


@pytest.mark.parametrize("form", ["object", "config"])
def test_codebook_from_an_object_or_a_config(llama, tmp_path, form):
    # --codebook also takes {"codebook": [...]} or a kbit checkpoint's config.json
    cb = [-1.0, -0.3, 0.2, 1.0]
    obj = {"codebook": cb} if form == "object" else {"quantization_config": {"quant_method": "kbit", "codebook": cb}}
    (tmp_path / "cb.json").write_text(json.dumps(obj))
    assert main([str(llama), str(tmp_path / "out"), "--bits", "2", "--codebook", str(tmp_path / "cb.json"),
                 "--device", "cpu"]) == 0
    assert torch.equal(torch.tensor(quant_config(tmp_path / "out")["codebook"]), torch.tensor(cb))  # float32
    src_t, out_t = load_checkpoint(llama), load_checkpoint(tmp_path / "out")
    assert_quantized(src_t, out_t, LINEARS[0], 2, torch.tensor(cb))


def test_underflow_blocks_are_reported(src_copy, tmp_path):
    name = f"{LINEARS[1]}.weight"
    # one non-zero block below half the smallest E4M4 value: stored as zeros
    rewrite_weight(src_copy, name, lambda w: w[3, 32:64].fill_(1e-6))
    report = convert(src_copy, tmp_path / "out", 4, progress=False)
    assert report.underflow_blocks == {name: 1}
    assert f"underflow {name}: 1 block(s) stored as zeros" in report.summary()


def test_moe_routers_are_ignored_by_default_and_experts_are_not():
    from vllm_kbit.convert import ConversionReport, _select, _select_experts
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.experts.3.w1", "model.layers.0.mlp.experts.3.w2",
             "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate", "model.layers.0.mlp.router",
             "model.layers.0.mlp.shared_experts.gate_proj", "lm_head"]
    shapes = {f"{n}.weight": [64, 64] for n in names}
    report = ConversionReport(src="s", dst="d", bits=4)
    selected = _select(dict.fromkeys(names), shapes, [], report)[0] | _select_experts(dict.fromkeys(names), shapes, report)[0]
    assert selected == {f"{n}.weight" for n in (names[0], names[1], names[2], names[6])}
    assert all("ignored" in report.skipped[f"{n}.weight"] for n in names[3:6] + names[7:])


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_every_architecture_converts_and_its_dequantization_computes_like_the_source(arch, tmp_path):
    """Per architecture (vllm_kbit.synthetic.ARCHITECTURES): exactly the attention and MLP
    projections are quantized, bit for bit as format.quantize does (fused ones included), and
    every other tensor (MoE experts, routers, embeddings, norms, biases) is kept byte for byte;
    the dequantized checkpoint, loaded by transformers, gives logits close to the source model's
    but not equal: a fused projection quantized with the wrong rows would move them far off."""
    from transformers import AutoModelForCausalLM

    src = make_random_model(tmp_path / "src", arch=arch, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, vocab_size=320, seed=SEED, init_std=0.05)
    report = convert(src, tmp_path / "kbit", 4, progress=False)
    src_t, out_t = load_file(src / "model.safetensors"), load_checkpoint(tmp_path / "kbit")
    # every linear weight but the routers, lm_head and the embeddings; MoE experts included
    expected = {n for n, t in src_t.items() if n.endswith(".weight") and t.dim() == 2 and "norm" not in n
                and "embed" not in n and n != "lm_head.weight" and not ROUTER_RE.fullmatch(n[:-len(".weight")])}
    assert len(expected) >= 8 and set(report.quantized) == expected, sorted(src_t)
    if arch in MOE_ARCHITECTURES:
        assert sum(".experts." in n for n in expected) >= 4 * 3, "every expert weight is quantized"
        assert all(ROUTER_RE.fullmatch(n[:-len(".weight")]) for n in report.skipped if n != "lm_head.weight")
    for name in src_t:  # nothing lost: a transformers load would fill a missing bias with zeros
        if name in expected:
            assert_quantized(src_t, out_t, name[: -len(".weight")], 4)
        else:
            assert name in out_t and same_bytes(src_t[name], out_t[name]), name
    assert len(out_t) == len(src_t) + len(expected), sorted(out_t.keys() - src_t.keys())
    # what is not quantized is named by a pattern of the config's ignore list, never one by one
    # (MoE experts: per-expert tensors in the file, one 3-D parameter in transformers 5)
    assert not report.unmapped_2d and set(quant_config(tmp_path / "kbit")["ignore"]) <= set(DEFAULT_IGNORE)
    deq = dequantized_copy(tmp_path / "kbit", tmp_path / "deq")
    ids = torch.randint(3, 259, (2, 24), generator=torch.Generator().manual_seed(SEED))
    logits = []
    for folder in (src, deq):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits.double())
    a, b = logits
    rel = ((a - b).norm() / a.norm()).item()
    print(f"{arch}: relative logit error {rel:.4f}")
    # K=4 on these models: 0.13-0.27 over seeds and architectures; one o_proj with its rows
    # reversed in the dequantized copy: 1.2-1.4 (llama, gemma2, phi3; 2026-11-22)
    assert 1e-4 < rel < 0.5


def test_unknown_architecture_uses_name_heuristic(src_copy, tmp_path, capsys):
    config = json.loads((src_copy / "config.json").read_text())
    config.update(model_type="kbit_unknown_arch", architectures=["KbitUnknownForCausalLM"])
    (src_copy / "config.json").write_text(json.dumps(config))
    report = convert(src_copy, tmp_path / "out", 4, progress=False)
    assert report.used_heuristic and "by name" in capsys.readouterr().err
    assert sorted(report.quantized) == sorted(f"{m}.weight" for m in LINEARS)


def _bin_only(p: Path) -> Path:
    p.mkdir()
    (p / "config.json").write_text(json.dumps({"model_type": "llama"}))
    torch.save({"w": torch.zeros(2)}, p / "pytorch_model.bin")
    return p


def _no_config(p: Path) -> Path:
    p.mkdir()
    save_file({"w": torch.zeros(2)}, str(p / "model.safetensors"))
    return p


def _already_quantized(llama: Path, p: Path) -> Path:
    shutil.copytree(llama, p)
    config = json.loads((p / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (p / "config.json").write_text(json.dumps(config))
    return p


def _edited_index(llama: Path, p: Path, case: str) -> Path:
    """A copy of the model whose index lists a missing file, or a tensor that a second file holds too."""
    shutil.copytree(llama, p)
    index = json.loads((p / INDEX_NAME).read_text())
    if case == "dup":
        save_file({"model.norm.weight": torch.ones(64)}, str(p / "extra.safetensors"), metadata={"format": "pt"})
        index["weight_map"]["extra.weight"] = "extra.safetensors"
    else:
        index["weight_map"]["extra.weight"] = "nope.safetensors"
    (p / INDEX_NAME).write_text(json.dumps(index))
    return p


def _not_safetensors(p: Path) -> Path:
    p.mkdir()
    (p / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (p / "model.safetensors").write_bytes(b"\xff" * 64)
    return p


@pytest.mark.parametrize("case, kwargs, error, message", [
    ("missing", {}, ConversionError, "does not exist"),
    ("dup", {}, ConversionError, "tensor model.norm.weight appears in more than one safetensors file"),
    ("index_missing", {}, ConversionError, "lists missing file\\(s\\): nope.safetensors"),
    ("not_safetensors", {}, ConversionError, "model.safetensors is not a safetensors file"),
    ("ok", {"max_shard_size": "0MB"}, ConversionError, "size must be positive"),
    ("bin_only", {}, ConversionError, "no \\*.safetensors"),
    ("no_config", {}, ConversionError, "has no config.json"),
    ("quantized", {}, ConversionError, "already quantized"),
    ("ok", {"bits": 1}, KbitFormatError, "bits must be one of"),
    ("ok", {"bits": 6}, KbitFormatError, "bits must be one of"),
    ("ok", {"codebook": [-1.0, 0.0, 1.0]}, KbitFormatError, "exactly 4"),
    ("ok", {"codebook": [1.0, 0.5, -0.5, -1.0]}, KbitFormatError, "ascending"),
    ("ok", {"codebook": [-2.0, -0.5, 0.5, 2.0]}, KbitFormatError, r"\[-1, 1\]"),
    ("ok", {"codebook": [-1.0, float("nan"), 0.5, 1.0]}, KbitFormatError, "non-finite"),
    ("ok", {"max_shard_size": "lots"}, ConversionError, "bad size"),
    ("ok", {"ignore": ["re:("]}, ConversionError, r"ignore='re:\(': bad regex"),
    ("ok", {"device": "tpu:x"}, ConversionError, "device='tpu:x': not a device"),
])
def test_bad_inputs(llama, tmp_path, case, kwargs, error, message):
    src = {"missing": lambda: tmp_path / "nope", "bin_only": lambda: _bin_only(tmp_path / "bin"),
           "no_config": lambda: _no_config(tmp_path / "nocfg"),
           "dup": lambda: _edited_index(llama, tmp_path / "dup", "dup"),
           "index_missing": lambda: _edited_index(llama, tmp_path / "idx", "missing"),
           "not_safetensors": lambda: _not_safetensors(tmp_path / "garbage"),
           "quantized": lambda: _already_quantized(llama, tmp_path / "q"), "ok": lambda: llama}[case]()
    kwargs = {"bits": 2, **kwargs}
    bits = kwargs.pop("bits")
    with pytest.raises(error, match=message):
        convert(src, tmp_path / "out", bits, progress=False, **kwargs)
    assert not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


@pytest.mark.parametrize("args, message", [
    (["{src}", "{dst}", "--bits", "7"], "bits must be one of"),
    (["{src}", "{dst}", "--bits", "four"], "not a number"),
    (["{src}", "{dst}"], "--bits"),
    (["{tmp}/nope", "{dst}", "--bits", "4"], "does not exist"),
    (["{src}", "{dst}", "--bits", "2", "--codebook", "[0.5, 0.1"], "--codebook"),
    (["{src}", "{dst}", "--bits", "2", "--codebook", "[-1, 0, 1]"], "exactly 4"),
    (["{src}", "{existing}", "--bits", "4"], "--overwrite"),
])
def test_cli_errors_are_one_line(llama, tmp_path, capsys, args, message):
    (tmp_path / "existing").mkdir()
    fill = {"src": llama, "dst": tmp_path / "out", "tmp": tmp_path, "existing": tmp_path / "existing"}
    assert main([a.format(**fill) for a in args]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    assert message in err, err
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path / "existing") == []


def test_unmapped_2d_weights_are_copied_and_listed_in_ignore(tmp_path):
    # A 2-D weight that no module of the architecture owns (e.g. after a key rename) is copied
    # as is; it must also be in the config's ignore list, or vLLM would expect kbit tensors.
    from safetensors.torch import load_file, save_file
    src = _tiny_llama(tmp_path / "src", SEED + 2)
    index_path = src / INDEX_NAME
    index = json.loads(index_path.read_text())
    shard = src / sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(shard)
    extra = "model.layers.0.mlp.extra_proj.weight"
    tensors[extra] = torch.randn(64, 64, generator=torch.Generator().manual_seed(SEED)).to(torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"][extra] = shard.name
    index["metadata"]["total_size"] += tensors[extra].numel() * tensors[extra].element_size()
    index_path.write_text(json.dumps(index))
    report = convert(src, tmp_path / "out", 4, progress=False)
    assert extra in report.unmapped_2d
    assert "model.layers.0.mlp.extra_proj" in quant_config(tmp_path / "out")["ignore"]
    assert same_bytes(load_checkpoint(src)[extra], load_checkpoint(tmp_path / "out")[extra])


@pytest.mark.parametrize("size, nbytes", [(4096, 4096), ("2GB", 2 * 10**9), ("512MiB", 512 * 2**20),
                                          ("100kb", 10**5), (" 1.5 GiB ", int(1.5 * 2**30)), ("123", 123)])
def test_parse_size(size, nbytes):
    assert parse_size(size) == nbytes


@pytest.mark.parametrize("size, message", [(0, "must be positive"), (-5, "must be positive"), ("0GB", "must be positive"),
                                           ("2 GBs", "bad size"), ("GB", "bad size")])
def test_parse_size_errors(size, message):
    with pytest.raises(ConversionError, match=message):
        parse_size(size)


def test_cuda_device_without_cuda_is_refused(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConversionError, match="device=cuda: CUDA is not available"):
        convert(llama, tmp_path / "out", 4, device="cuda", progress=False)
    assert not (tmp_path / "out").exists()


def _tiny_moe(dst: Path, arch: str = "qwen2_moe") -> Path:
    return make_random_model(dst, arch=arch, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                             num_kv_heads=2, vocab_size=320, seed=SEED)


@pytest.mark.parametrize("pattern", [r"re:.*\.experts(\..*)?$", r"re:.*\.experts\.\d+\..*"])
def test_ignored_moe_experts_stay_float(tmp_path, pattern, capsys):
    """--ignore keeps every expert of a layer float (the shared expert stays kbit); the config's
    ignore list then names the fused layer vLLM matches, by the pattern or by exact name; the
    pattern counts as used (no note that it matches nothing)."""
    src = _tiny_moe(tmp_path / "src")
    capsys.readouterr()
    report = convert(src, tmp_path / "kbit", 4, ignore=[pattern], progress=False)
    assert "matches no linear layer" not in capsys.readouterr().err
    src_t, out_t = load_file(src / "model.safetensors"), load_checkpoint(tmp_path / "kbit")
    experts = [n for n in src_t if ".experts." in n]
    assert len(experts) == 2 * 4 * 3
    for name in experts:
        assert_kept(src_t, out_t, name[:-len(".weight")])
    assert_quantized(src_t, out_t, "model.layers.1.mlp.shared_expert.down_proj", 4)
    assert_kept(src_t, out_t, "model.layers.0.mlp.shared_expert_gate")
    ignore = quant_config(tmp_path / "kbit")["ignore"]
    assert pattern in ignore
    if "\\d" in pattern:  # a per-expert pattern does not name the fused layer: the layers are listed
        assert {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"} <= set(ignore)
    assert re.search(r"unquantized 24 weights .*ignored", report.summary()), report.summary()


def test_partly_ignored_moe_experts_are_refused(tmp_path):
    src = _tiny_moe(tmp_path / "src", "mixtral")
    with pytest.raises(ConversionError, match=r"block_sparse_moe\.experts: 4 of its 12 expert weights .* one scheme"):
        convert(src, tmp_path / "kbit", 4, ignore=[r"re:.*\.experts\.\d+\.w2$"], progress=False)
    assert not (tmp_path / "kbit").exists()


def test_fused_3d_experts_are_refused_unless_ignored(tmp_path):
    """gpt-oss style: all experts of a layer in one 3-D tensor, which vLLM copies into its own
    float layout: convert refuses to quantize them, and copies them when they are ignored."""
    src = _tiny_llama(tmp_path / "src", SEED)
    index = json.loads((src / INDEX_NAME).read_text())
    shard = src / sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(shard)
    fused = "model.layers.0.mlp.experts.gate_up_proj"
    tensors[fused] = torch.randn(4, 64, 256, generator=torch.Generator().manual_seed(SEED)).to(torch.bfloat16)
    save_file(tensors, shard, metadata={"format": "pt"})
    index["weight_map"][fused] = shard.name
    (src / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ConversionError, match=rf"{re.escape(fused)} holds all experts .* --ignore"):
        convert(src, tmp_path / "kbit", 4, progress=False)
    convert(src, tmp_path / "kbit", 4, ignore=[r"re:.*\.experts(\..*)?$"], progress=False)
    assert same_bytes(load_checkpoint(tmp_path / "kbit")[fused], tensors[fused])


def test_fit_codebook_stores_one_codebook_per_fused_group(llama, tmp_path):
    bits = 3
    report = convert(llama, tmp_path / "out", bits, method="mse", fit_codebook=True, progress=False, device="cpu")
    qc = quant_config(tmp_path / "out")
    assert qc["codebook_per_layer"] is True
    src_t, out_t = load_checkpoint(llama), load_checkpoint(tmp_path / "out")
    assert sorted(report.quantized) == sorted(f"{m}.weight" for m in LINEARS)
    cbs = {m: out_t[f"{m}.codebook"] for m in LINEARS}
    for m, cb in cbs.items():
        assert cb.dtype == torch.float32 and cb.shape == (1 << bits,), m
        kf.check_codebook(cb, bits)
        assert_quantized(src_t, out_t, m, bits, cb, method="mse")
    for i in range(LAYERS):  # vLLM's qkv_proj / gate_up_proj are one layer: one codebook each
        p = f"model.layers.{i}"
        assert torch.equal(cbs[f"{p}.self_attn.q_proj"], cbs[f"{p}.self_attn.k_proj"])
        assert torch.equal(cbs[f"{p}.self_attn.q_proj"], cbs[f"{p}.self_attn.v_proj"])
        assert torch.equal(cbs[f"{p}.mlp.gate_proj"], cbs[f"{p}.mlp.up_proj"])
        assert not torch.equal(cbs[f"{p}.self_attn.q_proj"], cbs[f"{p}.mlp.down_proj"])
        assert not torch.equal(cbs[f"{p}.self_attn.q_proj"], default_codebook(bits))


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_methods_via_cli(llama, tmp_path, method):
    """rtn: format.quantize bit for bit; gptq: calibrated on a text file, a valid checkpoint
    whose layer outputs are closer to the source's than rtn's on the calibration text."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"The value of item {i} is {i * 7 % 13} and the next one follows." for i in range(400)))
    args = [str(llama), str(tmp_path / method), "--bits", "3", "--device", "cpu", "--method", method]
    assert main(args + (["--calib", str(text)] if method == "gptq" else [])) == 0
    src_t, out_t = load_checkpoint(llama), load_checkpoint(tmp_path / method)
    if method == "rtn":
        for m in LINEARS:
            q_ref, a_ref = kf.quantize(src_t[f"{m}.weight"], 3, default_codebook(3))
            assert torch.equal(out_t[f"{m}.qweight"], q_ref) and torch.equal(out_t[f"{m}.absmax"], a_ref)
        return
    rtn = tmp_path / "rtn"
    assert main([str(llama), str(rtn), "--bits", "3", "--device", "cpu", "--method", "rtn"]) == 0
    ids = AutoTokenizer.from_pretrained(llama)(text.read_text()[:2000], return_tensors="pt").input_ids[:, :128]
    logits = {}
    for name, folder in (("src", llama), ("gptq", dequantized_copy(tmp_path / "gptq", tmp_path / "dg")),
                         ("rtn", dequantized_copy(rtn, tmp_path / "dr"))):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            logits[name] = model(ids).logits.double()
    err = {m: ((logits[m] - logits["src"]).norm() / logits["src"].norm()).item() for m in ("gptq", "rtn")}
    assert err["gptq"] < err["rtn"], err


def test_calib_needs_gptq_and_a_file(llama, tmp_path):
    with pytest.raises(ConversionError, match="calib=x.txt is only used by method=gptq"):
        convert(llama, tmp_path / "o", 4, method="mse", calib="x.txt", progress=False)
    with pytest.raises(ConversionError, match="no such file"):
        convert(llama, tmp_path / "o", 4, method="gptq", calib=str(tmp_path / "missing.txt"), progress=False)
    with pytest.raises(ConversionError, match="method='awq': must be one of"):
        convert(llama, tmp_path / "o", 4, method="awq", progress=False)
    assert not (tmp_path / "o").exists()
