"""Install vllm_kbit and its test dependencies on a CPU-only machine (CI, laptops); run by
scripts/install_cpu.sh with the Python to install into.

vLLM 0.24.0 pins torch==2.11.0, a CUDA build. Its Python layers import and run on the CPU wheel
of torch 2.13.0, so the steps are:
  1. torch 2.13.0 from PyTorch's CPU index when that index answers (a few seconds' probe); else
     from whatever pip resolves by default, which on the public index is the CUDA build;
  2. the vLLM wheel without its dependencies, then the pure-Python packages it needs (pinned in
     cpu-vllm-0.24-requirements.txt), constrained to the torch of step 1;
  3. this package, editable: with a CUDA torch it is installed with VLLM_KBIT_NO_CUDA=1, since a
     CPU machine runs the PyTorch reference (without nvcc setup.py would stop; with it, it would
     spend half an hour compiling kernels that cannot run here).
The last line says which torch was installed and whether the install is reference-only.

Standard library only: it runs before torch exists. Everything that touches the machine goes
through a Runner, so tests replay the decisions with a fake pip.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
TORCH = "torch==2.13.0"
VLLM = "vllm==0.24.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
REQUIREMENTS = HERE / "cpu-vllm-0.24-requirements.txt"
PROBE_TIMEOUT_S = 5
# "vllm 0.24.0 requires torch==2.11.0, but you have torch 2.13.0+cpu which is incompatible."
# "vllm 0.24.0 requires xgrammar==0.1.21, which is not installed."
_CONFLICT = re.compile(r"^(?P<pkg>\S+) \S+ requires (?P<req>.+?)(, but you have .* which is incompatible"
                       r"|, which is not installed)\.$")
_RESOLVER_HEADER = re.compile(r"^ERROR: pip's dependency resolver does not currently take into account")


@dataclass
class Result:
    returncode: int
    output: str = ""


class Runner:
    """The machine: pip and python processes, the network, PATH."""

    def run(self, cmd: list[str], env: dict | None = None) -> Result:
        p = subprocess.run(cmd, env=None if env is None else {**os.environ, **env},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return Result(p.returncode, p.stdout)

    def reachable(self, url: str) -> str | None:
        """None when `url` answers within PROBE_TIMEOUT_S, else why not."""
        try:
            with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S):
                return None
        except Exception as e:  # DNS, refused, timeout, proxy, TLS, HTTP error: all mean "fall back"
            return f"{type(e).__name__}: {e}"

    def which(self, name: str) -> str | None:
        return shutil.which(name)


def quiet_conflicts(output: str) -> tuple[list[str], list[str]]:
    """Split pip's output into the lines to show and vLLM's expected conflicts (its CUDA pins,
    and the CUDA-only packages left out on purpose). Other packages' conflicts are shown."""
    shown, vllm = [], []
    for line in output.splitlines():
        m = _CONFLICT.match(line.strip())
        if m and m["pkg"] == "vllm":
            vllm.append(m["req"])
        elif not _RESOLVER_HEADER.match(line) and line.strip():
            shown.append(line)
    return shown, vllm


@dataclass
class Installer:
    python: str
    runner: Runner = field(default_factory=Runner)
    torch_index: str | None = CPU_INDEX
    say: callable = print
    log: list[str] = field(default_factory=list)  # what was decided, for the last line and tests

    def pip(self, *args: str, env: dict | None = None) -> Result:
        return self.runner.run([self.python, "-m", "pip", "install", "-q", *args], env=env)

    def must(self, what: str, res: Result) -> Result:
        if res.returncode != 0:
            raise SystemExit(f"install_cpu: {what} failed (pip exit status {res.returncode}):\n{res.output.strip()}")
        return res

    def install_torch(self) -> None:
        why = "no CPU index given" if not self.torch_index else self.runner.reachable(f"{self.torch_index}/torch/")
        if why is None:
            res = self.pip(TORCH, "--index-url", self.torch_index)
            if res.returncode == 0:
                self.log.append(f"torch from PyTorch's CPU index ({self.torch_index})")
                return
            why = f"pip failed there: {res.output.strip().splitlines()[-1:] or res.returncode}"
        self.say(f"install_cpu: PyTorch's CPU index is not used ({why}); resolving {TORCH} from pip's "
                 f"configured index instead")
        self.must(f"pip install {TORCH}", self.pip(TORCH))
        self.log.append("torch from pip's configured index")

    def torch_build(self) -> tuple[str, str | None]:
        res = self.must("import torch", self.runner.run(
            [self.python, "-c", "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda]))"]))
        version, cuda = json.loads(res.output.strip().splitlines()[-1])
        return version, cuda

    def install_vllm(self) -> None:
        self.must(f"pip install --no-deps {VLLM}", self.pip("--no-deps", VLLM))
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(TORCH + "\n")  # never another torch (a CUDA build) for vLLM's dependencies
        try:
            res = self.pip("-r", str(REQUIREMENTS), "-c", f.name)
        finally:
            os.unlink(f.name)
        shown, vllm = quiet_conflicts(res.output)
        if shown:
            self.say("\n".join(shown))
        self.must("pip install -r cpu-vllm-0.24-requirements.txt", Result(res.returncode))
        if vllm:
            self.say(f"install_cpu: pip lists {len(vllm)} unmet requirement(s) of vLLM ({vllm[0]}, ...): its CUDA "
                     f"pins, expected on a CPU install")

    def plugin_env(self, cuda: str | None) -> dict:
        if cuda is None:
            self.log.append("CPU torch: reference-only install (no CUDA extension)")
            return {}
        nvcc = self.runner.which("nvcc")
        why = "no nvcc on PATH" if nvcc is None else f"nvcc at {nvcc}, but kernels cannot run on a CPU machine"
        self.log.append(f"CUDA {cuda} torch, {why}: VLLM_KBIT_NO_CUDA=1, reference-only install")
        return {"VLLM_KBIT_NO_CUDA": "1"}

    def install(self) -> int:
        self.install_torch()
        version, cuda = self.torch_build()
        self.install_vllm()
        env = self.plugin_env(cuda)
        self.must("pip install -e . (vllm_kbit)",
                  self.pip("--no-build-isolation", "--no-deps", "-e", str(HERE.parent), env=env))
        res = self.must("import vllm_kbit", self.runner.run(
            [self.python, "-c", "import vllm, vllm_kbit; print(vllm.__version__)"]))
        self.say(f"install_cpu: torch {version}, vLLM {res.output.strip().splitlines()[-1]}; " + "; ".join(self.log))
        return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-index", default=CPU_INDEX,
                    help=f"PyTorch's CPU wheel index (default {CPU_INDEX}); 'none' resolves torch from pip's own")
    args = ap.parse_args(argv)
    if sys.prefix == sys.base_prefix:
        print(f"install_cpu: installing into {sys.prefix}, not a virtual environment "
              f"(python3 -m venv .venv && . .venv/bin/activate first keeps it apart)")
    index = None if args.torch_index == "none" else args.torch_index.rstrip("/")
    return Installer(sys.executable, torch_index=index).install()


if __name__ == "__main__":
    sys.exit(main())
