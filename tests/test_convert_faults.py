"""Converter faults: truncated shards, out-of-range weights (all reported at once, before
anything is written), SIGTERM mid-conversion, and temporary folders of killed conversions.

Inputs are fresh random tiny Llamas (see test_convert.py); KBIT_TEST_SEED replays a run."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from vllm_kbit import convert as kconvert
from vllm_kbit import format as kf
from vllm_kbit.convert import INDEX_NAME, ConversionError, convert, main
from vllm_kbit.format import KbitFormatError

from test_convert import SEED, _tiny_llama, _tiny_moe, rewrite_weight

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    print(f"KBIT_TEST_SEED={SEED}")
    return _tiny_llama(tmp_path_factory.mktemp("src") / "llama", SEED + 7)


@pytest.fixture
def src_copy(llama, tmp_path) -> Path:
    import shutil
    return Path(shutil.copytree(llama, tmp_path / "src"))


@pytest.fixture
def nothing_written(monkeypatch):
    """Fail the test if convert gets as far as creating its temporary folder."""
    def refuse(*args, **kwargs):
        raise AssertionError("convert created its temporary folder before finding the fault")
    monkeypatch.setattr(kconvert.tempfile, "mkdtemp", refuse)


def shards(src: Path) -> list[Path]:
    return [src / n for n in sorted(set(json.loads((src / INDEX_NAME).read_text())["weight_map"].values()))]


@pytest.mark.parametrize("how", ["truncated", "extended"])
def test_incomplete_shard_is_found_before_anything_is_written(src_copy, tmp_path, nothing_written, capsys, how):
    victim = shards(src_copy)[-1]  # the last one: a lazy check would reach it after writing the others
    size = victim.stat().st_size
    if how == "truncated":
        os.truncate(victim, size // 2)  # `truncate -s 50%`: the header stays intact
    else:
        with open(victim, "ab") as f:
            f.write(b"\0" * 16)
    with pytest.raises(ConversionError, match=re.escape(str(victim))) as e:
        convert(src_copy, tmp_path / "out", 4, progress=False)
    assert ("is truncated" if how == "truncated" else "longer than its header says") in str(e.value)
    assert not (tmp_path / "out").exists()

    capsys.readouterr()
    assert main([str(src_copy), str(tmp_path / "out"), "--bits", "4"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and str(victim) in err and "\n" not in err


def test_all_out_of_range_weights_are_reported_at_once(src_copy, tmp_path, nothing_written, capsys):
    gen = torch.Generator().manual_seed(SEED)
    poisoned = {"model.layers.0.mlp.down_proj.weight": 3 * kf.E4M4_MAX,
                "model.layers.1.self_attn.k_proj.weight": kf.E4M4_MAX + 0.5,
                "model.layers.1.mlp.up_proj.weight": -kf.E4M4_MAX - 1}
    for name, value in poisoned.items():
        def edit(w, value=value):
            w[torch.randint(w.shape[0], (1,), generator=gen), torch.randint(w.shape[1], (1,), generator=gen)] = value
        rewrite_weight(src_copy, name, edit)
    with pytest.raises(KbitFormatError) as e:
        convert(src_copy, tmp_path / "out", 4, progress=False)
    msg = str(e.value)
    assert "3 weight(s)" in msg
    for name in poisoned:
        assert name in msg
    assert f"max |w| = {3 * kf.E4M4_MAX:.4g}" in msg and "max |w| = 31.5" in msg and "max |w| = 32" in msg
    # the hint ignores whole fused groups (vLLM's qkv_proj / gate_up_proj need one scheme)
    hint = re.findall(r"--ignore (\S+)", msg)
    assert sorted(hint) == sorted(["model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj",
                                   "model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.v_proj",
                                   "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"])
    assert not (tmp_path / "out").exists()


def test_following_the_ignore_hint_converts(src_copy, tmp_path):
    rewrite_weight(src_copy, "model.layers.0.self_attn.v_proj.weight", lambda w: w.__setitem__((0, 0), -40.0))
    with pytest.raises(KbitFormatError) as e:
        convert(src_copy, tmp_path / "out", 3, progress=False)
    ignore = re.findall(r"--ignore (\S+)", str(e.value))
    assert len(ignore) == 3
    report = convert(src_copy, tmp_path / "out", 3, ignore=ignore, progress=False)
    assert "model.layers.0.self_attn.v_proj.weight" in report.skipped
    assert "model.layers.1.self_attn.v_proj.weight" in report.quantized


def test_out_of_range_expert_hint_ignores_its_moe_layer(tmp_path, capsys):
    """An expert weight out of range: the hint names its MoE layer (vLLM runs a layer's experts
    as one fused layer, so ignoring one expert's projections is refused), and following it
    converts with that layer float, the other layer's experts kbit, and no note that the
    pattern matches nothing."""
    from safetensors.torch import load_file, save_file
    src = _tiny_moe(tmp_path / "src", "mixtral")
    shard = src / "model.safetensors"
    tensors = load_file(shard)
    gen = torch.Generator().manual_seed(SEED)
    victim = f"model.layers.1.block_sparse_moe.experts.{int(torch.randint(4, (1,), generator=gen))}.w1.weight"
    tensors[victim] = tensors[victim].clone()
    tensors[victim][0, int(torch.randint(tensors[victim].shape[1], (1,), generator=gen))] = 2 * kf.E4M4_MAX
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(KbitFormatError, match=re.escape(victim)) as e:
        convert(src, tmp_path / "out", 4, progress=False)
    hint = re.findall(r"--ignore (\S+)", str(e.value))
    assert hint == ["model.layers.1.block_sparse_moe.experts"]
    capsys.readouterr()
    report = convert(src, tmp_path / "out", 4, ignore=hint, progress=False)
    assert "matches no linear layer" not in capsys.readouterr().err
    assert victim in report.skipped and "model.layers.0.block_sparse_moe.experts.0.w1.weight" in report.quantized
    assert hint[0] in report.ignore


# The child converts with a pause once the shards are in the temporary folder, and says so.
CHILD = textwrap.dedent("""
    import sys, time
    from vllm_kbit import convert as c
    write = c._write_shards
    def write_then_wait(*args, **kwargs):
        write(*args, **kwargs)
        print("WRITTEN", flush=True)
        time.sleep(120)
    c._write_shards = write_then_wait
    sys.exit(c.main(sys.argv[1:]))
""")


def temps(folder: Path, dst_name: str = "out") -> list[str]:
    return [n for n in os.listdir(folder) if n.startswith(f".{dst_name}.kbit-tmp-")]


def test_sigterm_mid_conversion_removes_the_temporary_folder(llama, tmp_path):
    dst = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(llama), str(dst), "--bits", "4"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "WRITTEN", p.stderr.read()
        (tmp,) = temps(tmp_path)
        assert any(n.endswith(".safetensors") for n in os.listdir(tmp_path / tmp))  # a real mid-way state
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
    finally:
        p.kill()
    assert p.returncode == -signal.SIGTERM  # the exit status says terminated
    assert "terminated (SIGTERM)" in p.stderr.read()
    assert temps(tmp_path) == [] and not dst.exists()


def test_sigterm_handler_is_restored_and_a_callers_handler_runs(llama, tmp_path, monkeypatch):
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        write = kconvert._write_shards

        def write_then_term(*args, **kwargs):
            write(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the signal arrives first
            raise AssertionError("SIGTERM did not unwind the conversion")
        monkeypatch.setattr(kconvert, "_write_shards", write_then_term)
        with pytest.raises(InterruptedError, match="SIGTERM"):
            convert(llama, tmp_path / "out", 4, progress=False)
        assert seen == [signal.SIGTERM]  # the caller's handler got the signal after the cleanup
        assert temps(tmp_path) == [] and not (tmp_path / "out").exists()
        monkeypatch.setattr(kconvert, "_write_shards", write)
        convert(llama, tmp_path / "out", 4, progress=False)
        assert signal.getsignal(signal.SIGTERM) is not None and seen == [signal.SIGTERM]
        handler = signal.getsignal(signal.SIGTERM)
        assert getattr(handler, "__name__", "") == "<lambda>"  # the caller's handler is back
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_stale_temporary_folders_of_dead_conversions_are_removed(llama, tmp_path, capsys):
    host, _ = kconvert._owner_tag().rsplit("-", 1)
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()  # a pid that was a conversion and is gone
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = tmp_path / f".out.kbit-tmp-{host}-{done.pid}-abc_1234"
        alive = tmp_path / f".out.kbit-tmp-{host}-{running.pid}-xyz98765"
        foreign = tmp_path / ".out.kbit-tmp-otherhost-1-q1w2e3r4"
        other_dst = tmp_path / f".other.kbit-tmp-{host}-{done.pid}-abc_1234"
        for d in (dead, alive, foreign, other_dst):
            d.mkdir()
            (d / "model-00001-of-00002.safetensors").write_bytes(b"partial")
        convert(llama, tmp_path / "out", 2, progress=False)
        err = capsys.readouterr().err
    finally:
        running.kill()
        running.wait()
    assert not dead.exists() and f"removed {dead}" in err
    assert alive.exists() and f"{alive} may belong to a conversion still running (process {running.pid}" in err
    assert foreign.exists() and str(foreign) in err
    assert other_dst.exists()  # another DST's folder is none of this conversion's business
    assert (tmp_path / "out" / "config.json").is_file()
    assert sorted(temps(tmp_path)) == sorted([alive.name, foreign.name])


# ----------------------------------------------------------------------------- a new user's mistakes

@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if convert loads the float model (gptq's slow step) before finding the fault."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the argument was checked")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def cli_error_line(capsys, argv) -> str:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 1
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]  # (after progress bars, if any)
    assert last.startswith("error: ") and err.count("error: ") == 1, err
    return last


def test_gptq_without_a_tokenizer_says_so(src_copy, tmp_path, nothing_written, no_model_load, capsys):
    for f in src_copy.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ConversionError, match=r"method=gptq needs SRC's tokenizer \(tokenizer.json"):
        convert(src_copy, tmp_path / "out", 4, method="gptq", progress=False)
    err = cli_error_line(capsys, [src_copy, tmp_path / "out", "--bits", "4", "--method", "gptq"])
    assert "--method gptq needs SRC's tokenizer" in err and f"into {src_copy}" in err and "--method mse" in err


def test_gptq_loads_the_model_with_hub_kernels_off(llama, tmp_path, monkeypatch):
    """transformers releases that turn Hub kernels on by default fail in from_pretrained without
    the `kernels` package; the converter asks for plain modules."""
    import transformers

    real = transformers.AutoModelForCausalLM.from_pretrained.__func__
    seen = {}

    def hub_kernels_by_default(cls, *args, **kwargs):
        seen.update(kwargs)
        if kwargs.get("use_kernels", True):
            raise ValueError("Kernels are not available. Please install a compatible version")
        return real(cls, *args, **kwargs)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(hub_kernels_by_default))
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"Item {i} weighs {i * 7 % 13} grams." for i in range(300)))
    report = convert(llama, tmp_path / "out", 4, method="gptq", calib=str(text), calib_samples=1,
                     device="cpu", progress=False)
    assert seen["use_kernels"] is False and len(report.quantized) > 0


@pytest.mark.parametrize("content", [b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 8,
                                     "plain text, then a NUL\0".encode()])
def test_calib_must_be_text_and_is_checked_first(llama, tmp_path, nothing_written, no_model_load, capsys, content):
    calib = tmp_path / "calib.bin"
    calib.write_bytes(content)
    with pytest.raises(ConversionError, match=re.escape(f"calib={calib}: not a plain-text (UTF-8) file")):
        convert(llama, tmp_path / "out", 4, method="gptq", calib=str(calib), progress=False)
    err = cli_error_line(capsys, [llama, tmp_path / "out", "--bits", "4", "--method", "gptq", "--calib", calib])
    assert f"--calib {calib}: not a plain-text" in err


def test_missing_calib_is_reported_before_the_model_loads(llama, tmp_path, nothing_written, no_model_load, capsys):
    err = cli_error_line(capsys, [llama, tmp_path / "out", "--bits", "4", "--method", "gptq",
                                  "--calib", tmp_path / "missing.txt"])
    assert f"--calib {tmp_path / 'missing.txt'}: no such file" in err


@pytest.mark.parametrize("text, kind", [("[1, 2]", "list"), ('"llama"', "str"), ("3", "int")])
def test_config_that_is_not_an_object(src_copy, tmp_path, nothing_written, capsys, text, kind):
    (src_copy / "config.json").write_text(text)
    err = cli_error_line(capsys, [src_copy, tmp_path / "out", "--bits", "4"])
    assert f"{src_copy / 'config.json'}: expected a JSON object (a model configuration), got a {kind}" in err


@pytest.mark.parametrize("victim, value", [("model.layers.1.mlp.up_proj.weight", float("nan")),
                                           ("model.layers.0.self_attn.o_proj.weight", float("inf")),
                                           ("model.embed_tokens.weight", float("nan")),
                                           ("lm_head.weight", float("-inf"))])
def test_nan_or_inf_anywhere_is_refused_whatever_is_ignored(src_copy, tmp_path, nothing_written, capsys,
                                                             victim, value):
    gen = torch.Generator().manual_seed(SEED)
    rewrite_weight(src_copy, victim, lambda w: w.view(-1).__setitem__(
        int(torch.randint(w.numel(), (1,), generator=gen)), value))
    module = victim[:-len(".weight")]
    ignore = [] if "embed" in victim else ["--ignore", module]
    if "up_proj" in victim:
        ignore += ["--ignore", module.replace("up_proj", "gate_proj")]  # its fused group, as the hint would say
    err = cli_error_line(capsys, [src_copy, tmp_path / "out", "--bits", "4", *ignore])
    assert f"1 tensor of SRC holds NaN or Inf values: {victim}" in err and "corrupt" in err
    assert "--ignore" not in err  # ignoring it would copy the NaN into the checkpoint


def test_ignoring_every_linear_is_refused(llama, tmp_path, nothing_written, capsys):
    err = cli_error_line(capsys, [llama, tmp_path / "out", "--bits", "4", "--ignore", "re:.*"])
    assert "nothing to quantize" in err and "ignored (matches 're:.*')" in err
    assert not (tmp_path / "out").exists()


def test_cli_errors_name_cli_options_and_the_api_its_arguments(llama, tmp_path, capsys):
    (tmp_path / "existing").mkdir()
    err = cli_error_line(capsys, [llama, tmp_path / "existing", "--bits", "4"])
    assert "use --overwrite to replace it" in err and "overwrite=True" not in err
    err = cli_error_line(capsys, [llama, tmp_path / "out", "--bits", "4", "--method", "gptq", "--calib-samples", "0"])
    assert "--calib-samples 0: must be at least 1" in err and "calib_samples" not in err
    err = cli_error_line(capsys, [llama, tmp_path / "out", "--bits", "4", "--calib", "x.txt"])
    assert "--calib x.txt is only used by --method gptq (got --method mse)" in err
    with pytest.raises(ConversionError, match="calib_samples=0: must be at least 1"):
        convert(llama, tmp_path / "out", 4, calib_samples=0)
    with pytest.raises(ConversionError, match="use overwrite=True to replace it"):
        convert(llama, tmp_path / "existing", 4)


def test_summary_counts_in_words(llama, tmp_path):
    src = tmp_path / "one_file"
    src.mkdir()
    for f in llama.iterdir():
        if f.suffix == ".safetensors" or f.name in ("config.json", INDEX_NAME, "tokenizer.json"):
            (src / f.name).write_bytes(f.read_bytes())
    summary = convert(src, tmp_path / "out", 4, progress=False).summary()
    assert "1 file copied" in summary and "1 files" not in summary


def test_gptq_calibration_shows_progress_and_no_warnings_that_do_not_apply(src_copy, tmp_path, capfd):
    """Sampling shows a progress bar and no right-padding warning (the batch starts with BOS,
    which is also the pad id); a calibration file longer than the tokenizer's model_max_length
    is cut into windows, so transformers' "indexing errors" warning does not apply."""
    import transformers

    from vllm_kbit.quant.plan import calibration_batches

    cfg = json.loads((src_copy / "tokenizer_config.json").read_text())
    (src_copy / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 64}))
    model = transformers.AutoModelForCausalLM.from_pretrained(src_copy, dtype=torch.float32).eval()
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"Item {i} weighs {i * 7 % 13} grams." for i in range(200)))
    capfd.readouterr()
    batches = calibration_batches(model, src_copy, str(text), 3, 32, "cpu", progress=True)
    assert len(batches) == 3 and all(b.shape == (1, 32) for b in batches)
    sampled = calibration_batches(model, src_copy, None, 3, 8, "cpu", progress=True)
    assert len(sampled) == 3 and all(b.shape == (1, 8) for b in sampled)
    err = capfd.readouterr().err
    assert "gptq sampling" in err and "3/3" in err, err
    assert "right-padding" not in err and "indexing errors" not in err, err
