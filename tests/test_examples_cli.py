"""The example scripts' error paths on the CPU: argparse usage or one clean line, no traceback."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_convert import SEED, _tiny_llama

ROOT = Path(__file__).resolve().parent.parent


def run_example(script, *args):
    # this checkout's vllm_kbit, whatever is installed (a script's own folder comes first on sys.path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(ROOT / "examples" / script), *map(str, args)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert "Traceback" not in p.stderr, p.stderr
    return p


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("src") / "llama", SEED + 11)


def one_line_error(p, *needles):
    assert p.returncode == 1, p.stdout + p.stderr
    err = p.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("args, message", [
    (["{src}"], "give SRC and DST"),
    (["--demo", "{tmp}/a", "{tmp}/b"], "--demo takes DST only"),
])
def test_convert_example_usage_errors(llama, tmp_path, args, message):
    p = run_example("convert_hf_model.py", *[a.format(src=llama, tmp=tmp_path) for a in args])
    assert p.returncode == 2 and p.stderr.startswith("usage: ") and message in p.stderr, p.stderr


def test_convert_example_converts_and_its_input_errors_are_one_line(llama, tmp_path):
    one_line_error(run_example("convert_hf_model.py", tmp_path / "nope", tmp_path / "out"),
                   f"SRC {tmp_path / 'nope'} does not exist")
    p = run_example("convert_hf_model.py", llama, tmp_path / "out", "--bits", "3")
    assert p.returncode == 0 and "kbit K=3:" in p.stdout, p.stderr
    before = sorted(os.listdir(tmp_path / "out"))
    p = run_example("convert_hf_model.py", llama, tmp_path / "out")
    one_line_error(p, "use --overwrite to replace it")
    assert "overwrite=True" not in p.stderr  # the script's option, not the API's argument
    assert sorted(os.listdir(tmp_path / "out")) == before and "config.json" in before


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without a GPU")
@pytest.mark.parametrize("script", ["offline_generate.py", "serve_and_query.py"])
def test_serving_examples_say_a_gpu_is_needed(llama, script):
    p = run_example(script, llama)
    one_line_error(p, f"{script} needs a CUDA GPU", "no CUDA GPU is visible")
    assert "Device string" not in p.stdout + p.stderr
