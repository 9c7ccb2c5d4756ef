"""setup.py's decision whether to build the CUDA extension (extension_plan), on fake toolkits."""
import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_setup():
    spec = importlib.util.spec_from_file_location("kbit_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: setup() does not run
    return module


SETUP = load_setup()
plan = SETUP.extension_plan


def toolkit(root: Path, nvcc=True, header=True) -> str:
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    if nvcc:
        (root / "bin" / "nvcc").write_text("")
    if header:
        (root / "include" / "cuda_runtime_api.h").write_text("")
    return str(root)


def test_full_toolkit_and_cuda_torch_builds(tmp_path):
    build, why = plan("2.11.0+cu128", "12.8", toolkit(tmp_path / "cuda"), {})
    assert build and "CUDA 12.8" in why


@pytest.mark.parametrize("var", ["VLLM_KBIT_NO_CUDA", "KBIT_NO_CUDA"])
def test_no_cuda_variable_gives_a_reference_install(tmp_path, var):
    build, why = plan("2.11.0+cu128", "12.8", toolkit(tmp_path / "cuda"), {var: "1"})
    assert not build and var in why
    build, _ = plan("2.11.0+cu128", "12.8", str(tmp_path / "none"), {var: "1"})  # headers not needed
    assert not build


def test_cpu_torch_builds_without_the_extension(tmp_path):
    build, why = plan("2.13.0+cpu", None, toolkit(tmp_path / "cuda"), {})
    assert not build and "CPU build" in why


def test_missing_runtime_header_fails_at_once_naming_the_file_and_both_fixes(tmp_path):
    home = toolkit(tmp_path / "cuda", header=False)
    with pytest.raises(SystemExit) as e:
        plan("2.11.0+cu128", "12.8", home, {})
    msg = str(e.value)
    assert os.path.join(home, "include", "cuda_runtime_api.h") in msg and "does not exist" in msg
    assert "headers" in msg and "VLLM_KBIT_NO_CUDA=1" in msg
    # headers found through CUDA_INC_PATH (torch's cpp_extension adds that folder too)
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "cuda_runtime_api.h").write_text("")
    assert plan("2.11.0+cu128", "12.8", home, {"CUDA_INC_PATH": str(inc)})[0]


@pytest.mark.parametrize("case", ["no_toolkit", "no_nvcc"])
def test_cuda_torch_without_a_toolkit_fails_at_once(tmp_path, case):
    home = None if case == "no_toolkit" else toolkit(tmp_path / "cuda", nvcc=False)
    with pytest.raises(SystemExit) as e:
        plan("2.11.0+cu128", "12.8", home, {})
    msg = str(e.value)
    assert "VLLM_KBIT_NO_CUDA=1" in msg and "12.x" in msg
    assert (case == "no_toolkit") == ("no CUDA toolkit is found" in msg)
    assert (case == "no_nvcc") == (os.path.join(home or "", "bin", "nvcc") in msg)


def test_isolated_build_without_torch(tmp_path):
    # no toolkit either: a pure-Python install is all this machine can have
    build, why = plan(None, None, None, {})
    assert not build and "torch is not importable" in why
    # a toolkit but no torch in the build environment: pip's build isolation hid the torch
    isolated = {"PYTHONPATH": "/tmp/pip-build-env-abc123/site"}
    with pytest.raises(SystemExit, match="--no-build-isolation"):
        plan(None, None, None, isolated, nvcc_on_path="/usr/local/cuda/bin/nvcc")


def test_environment_without_torch_says_install_torch_first():
    # `pip install --no-build-isolation .` in a fresh venv: the fix is torch, not that command again
    with pytest.raises(SystemExit) as e:
        plan(None, None, "/usr/local/cuda", {}, nvcc_on_path="/usr/local/cuda/bin/nvcc")
    msg = str(e.value)
    assert "torch is not installed in this environment" in msg and "Install torch first" in msg
    assert "--no-build-isolation" not in msg and "VLLM_KBIT_NO_CUDA=1" in msg


@pytest.mark.parametrize("isolated", [False, True])
def test_setup_py_without_torch_gives_the_fix_for_how_it_was_run(tmp_path, isolated):
    """setup.py itself, as pip runs it, with torch unimportable and a toolkit on PATH."""
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_HOME", "CUDA_PATH")}
    env["PATH"] = f"{nvcc.parent}{os.pathsep}{env['PATH']}"
    if isolated:
        env["PYTHONPATH"] = str(tmp_path / "pip-build-env-x" / "site")
    code = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--version']; "
            f"runpy.run_path({str(ROOT / 'setup.py')!r}, run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert p.returncode != 0
    assert ("--no-build-isolation" in p.stderr) == isolated, p.stderr
    assert ("Install torch first" in p.stderr) == (not isolated), p.stderr


@pytest.mark.parametrize("version, requirement", [(None, "torch"), ("2.11.0+cu130", "torch==2.11.*"),
                                                  ("2.13.0", "torch==2.13.*")])
def test_a_build_with_the_extension_requires_its_torch(version, requirement):
    assert SETUP.torch_requirement(version) == requirement


def test_build_requires_no_torch():
    # an isolated build environment would fetch a torch of its own to compile against
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert not [r for r in requires if r.split(">")[0].split("=")[0].strip() == "torch"], requires


def test_build_info_is_written_for_the_check(tmp_path, monkeypatch):
    monkeypatch.setattr(SETUP, "BUILD_INFO", str(tmp_path / "_build_info.py"))
    SETUP.write_build_info(True, "why", "8.0;9.0a", "2.11.0+cu130")
    info = {}
    exec((tmp_path / "_build_info.py").read_text(), info)
    assert info["EXTENSION"] is True and info["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0a" and info["REASON"] == "why"
    assert info["TORCH"] == "2.11.0+cu130"
