"""scripts/install_cpu.py's decisions, replayed against a fake machine: which index torch comes
from, what the plugin step gets when the torch is a CUDA build, and pip's noise."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("install_cpu", ROOT / "scripts" / "install_cpu.py")
ic = importlib.util.module_from_spec(spec)
sys.modules["install_cpu"] = ic  # dataclasses look their module up there
spec.loader.exec_module(ic)

VLLM_CONFLICTS = """\
ERROR: pip's dependency resolver does not currently take into account all the packages that are installed. This behaviour is the source of the following dependency conflicts.
vllm 0.24.0 requires torch==2.11.0, but you have torch 2.13.0 which is incompatible.
vllm 0.24.0 requires torchaudio==2.11.0, which is not installed.
vllm 0.24.0 requires torchvision==0.26.0, which is not installed.
vllm 0.24.0 requires xformers==0.0.33; platform_system == "Linux" and platform_machine == "x86_64", which is not installed.
vllm 0.24.0 requires flashinfer-python==0.5.3, which is not installed.
vllm 0.24.0 requires nvidia-cutlass-dsl>=4.3.0, which is not installed.
"""


class FakeMachine(ic.Runner):
    """pip and python as a machine would answer: `index_up` whether PyTorch's CPU index answers,
    `default_torch_cuda` the CUDA version of the torch that pip's own index resolves (the public
    index: a CUDA build), `nvcc` where nvcc is."""

    def __init__(self, index_up: bool, default_torch_cuda: str | None, nvcc: str | None = None,
                 cpu_index_pip_fails: bool = False, extra_conflicts: str = ""):
        self.index_up, self.default_cuda, self.nvcc = index_up, default_torch_cuda, nvcc
        self.cpu_index_pip_fails, self.extra = cpu_index_pip_fails, extra_conflicts
        self.calls: list[tuple[list[str], dict | None]] = []
        self.torch = None  # (version, cuda) once installed

    def run(self, cmd, env=None):
        self.calls.append((cmd, env))
        if cmd[1] == "-c":
            if "torch.version.cuda" in cmd[2]:
                return ic.Result(0, json.dumps(list(self.torch)) + "\n")
            return ic.Result(0, "0.24.0\n")
        args = cmd[5:]  # python -m pip install -q ...
        if args[0] == ic.TORCH:
            if "--index-url" in args:
                if self.cpu_index_pip_fails:
                    return ic.Result(1, "ERROR: Could not find a version that satisfies the requirement torch==2.13.0")
                self.torch = ("2.13.0+cpu", None)
            else:
                self.torch = ("2.13.0" if self.default_cuda else "2.13.0+cpu", self.default_cuda)
            return ic.Result(0)
        if args[0] == "-r":
            return ic.Result(0, VLLM_CONFLICTS + self.extra)
        return ic.Result(0)

    def reachable(self, url):
        assert url == f"{ic.CPU_INDEX}/torch/"
        return None if self.index_up else "URLError: <urlopen error [Errno -2] Name or service not known>"

    def which(self, name):
        return self.nvcc if name == "nvcc" else None


def install(machine, **kw):
    said = []
    inst = ic.Installer("py", runner=machine, say=said.append, **kw)
    assert inst.install() == 0
    plugin = [(cmd, env) for cmd, env in machine.calls if "-e" in cmd]
    assert len(plugin) == 1 and plugin[0][0][-1] == str(ROOT)
    return said, plugin[0][1]


def pip_torch_calls(machine):
    return [cmd[5:] for cmd, _ in machine.calls if cmd[5:6] == [ic.TORCH]]


def test_public_index_only_gives_a_cuda_torch_and_a_reference_only_plugin():
    m = FakeMachine(index_up=False, default_torch_cuda="13.0")
    said, env = install(m)
    assert pip_torch_calls(m) == [[ic.TORCH]]  # the CPU index was not tried once it did not answer
    assert env == {"VLLM_KBIT_NO_CUDA": "1"}  # setup.py would stop: a CUDA torch without nvcc
    assert "PyTorch's CPU index is not used (URLError" in said[0]
    assert said[-1].startswith("install_cpu: torch 2.13.0, vLLM 0.24.0")
    assert "CUDA 13.0 torch, no nvcc on PATH: VLLM_KBIT_NO_CUDA=1, reference-only install" in said[-1]


def test_cuda_torch_with_nvcc_still_skips_the_kernels():
    # compiling every kernel for four architectures takes half an hour and runs nothing here
    m = FakeMachine(index_up=False, default_torch_cuda="13.0", nvcc="/usr/local/cuda/bin/nvcc")
    said, env = install(m)
    assert env == {"VLLM_KBIT_NO_CUDA": "1"} and "nvcc at /usr/local/cuda/bin/nvcc" in said[-1]


def test_cpu_index_is_preferred_where_it_answers():
    m = FakeMachine(index_up=True, default_torch_cuda="13.0")
    said, env = install(m)
    assert pip_torch_calls(m) == [[ic.TORCH, "--index-url", ic.CPU_INDEX]]
    assert env == {} and "torch 2.13.0+cpu" in said[-1] and "PyTorch's CPU index" in said[-1]
    assert "CPU torch: reference-only install" in said[-1]


def test_cpu_index_that_fails_falls_back():
    m = FakeMachine(index_up=True, default_torch_cuda="13.0", cpu_index_pip_fails=True)
    said, env = install(m)
    assert pip_torch_calls(m) == [[ic.TORCH, "--index-url", ic.CPU_INDEX], [ic.TORCH]]
    assert "pip failed there" in said[0] and env == {"VLLM_KBIT_NO_CUDA": "1"}


def test_no_cpu_index_asked_for():
    m = FakeMachine(index_up=True, default_torch_cuda=None)
    said, env = install(m, torch_index=None)
    assert pip_torch_calls(m) == [[ic.TORCH]] and env == {}


def test_vllm_conflicts_are_one_line_and_others_are_shown():
    other = "somepkg 1.0 requires numpy<2, but you have numpy 2.2.0 which is incompatible.\n"
    m = FakeMachine(index_up=False, default_torch_cuda=None, extra_conflicts=other)
    said, _ = install(m)
    text = "\n".join(said)
    assert "vllm 0.24.0 requires" not in text and "dependency resolver" not in text
    assert other.strip() in text
    summary = [s for s in said if "unmet requirement(s) of vLLM" in s]
    assert len(summary) == 1 and "6 unmet" in summary[0] and "torch==2.11.0" in summary[0]


def test_vllm_dependency_install_is_constrained_to_the_cpu_torch():
    m = FakeMachine(index_up=False, default_torch_cuda=None)
    seen = {}
    real_run = m.run

    def run(cmd, env=None):
        if "-c" in cmd[5:] and "-r" in cmd[5:]:
            seen["constraint"] = Path(cmd[cmd.index("-c", 5) + 1]).read_text()
        return real_run(cmd, env)
    m.run = run
    install(m)
    assert seen["constraint"].strip() == ic.TORCH


def test_failed_step_stops_with_pips_output():
    m = FakeMachine(index_up=False, default_torch_cuda=None)
    real_run = m.run
    m.run = lambda cmd, env=None: (ic.Result(1, "ERROR: No matching distribution found for vllm==0.24.0")
                                   if ic.VLLM in cmd else real_run(cmd, env))
    with pytest.raises(SystemExit, match="(?s)pip install --no-deps vllm==0.24.0 failed.*No matching distribution"):
        ic.Installer("py", runner=m, say=lambda s: None).install()


def test_unreachable_index_is_answered_quickly():
    # a closed local port: refused at once; the probe's timeout bounds the rest
    assert ic.PROBE_TIMEOUT_S <= 10
    assert ic.Runner().reachable("http://127.0.0.1:9/torch/") is not None


def test_shell_script_runs_the_module_with_the_chosen_python(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'argv'}\n")
    fake.chmod(0o755)
    p = subprocess.run(["bash", str(ROOT / "scripts" / "install_cpu.sh"), "--torch-index", "none"],
                       env={**os.environ, "PYTHON": str(fake)}, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "argv").read_text().split() == [str(ROOT / "scripts" / "install_cpu.py"),
                                                     "--torch-index", "none"]
