"""The source distribution: built as CI builds it (setuptools' PEP 517 hooks, what
`python -m build --sdist` calls) from the tracked files, it carries every CUDA source, the
package and its docs, nothing built, and builds a wheel by itself."""
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def tracked(prefix: str = "") -> set[str]:
    out = subprocess.run(["git", "ls-files", *([prefix] if prefix else [])], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return {line for line in out.splitlines() if (ROOT / line).is_file()}  # (deleted in the work tree: not shipped)


def pep517(hook: str, src: Path, out: Path, env: dict | None = None) -> Path:
    code = f"from setuptools import build_meta as b; print(b.{hook}({str(out)!r}))"
    p = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    assert p.returncode == 0, p.stdout + p.stderr
    return out / p.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (the sdist is built from its tracked files)")
    tree = tmp_path_factory.mktemp("tree")
    for name in tracked():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, tree / name)
    (tree / "vllm_kbit" / "_build_info.py").write_text("EXTENSION = False\n")  # what a local build leaves
    path = pep517("build_sdist", tree, tmp_path_factory.mktemp("dist"), {"VLLM_KBIT_NO_CUDA": "1"})
    with tarfile.open(path) as tar:
        names = tar.getnames()
    top = names[0].split("/")[0]
    return path, top, {n[len(top) + 1:] for n in names if n != top}


def test_sdist_carries_the_sources_and_nothing_built(sdist):
    path, top, files = sdist
    assert top == "vllm_kbit-0.1.0" and path.name == "vllm_kbit-0.1.0.tar.gz"
    cuda = tracked("csrc")
    assert any(f.endswith(".cu") for f in cuda) and any(f.endswith(".cuh") for f in cuda)
    assert cuda <= files, sorted(cuda - files)  # every kernel source and the generator
    package = {f for f in tracked("vllm_kbit") if f.endswith(".py")}
    assert package <= files, sorted(package - files)
    assert {"setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "docs/FORMAT.md",
            "examples/quickstart.py"} <= files
    assert "vllm_kbit/_build_info.py" not in files  # it describes one build, not the source
    assert not [f for f in files if f.endswith((".so", ".o", ".pyc")) or f.startswith(("tests/", "build/"))]
    assert path.stat().st_size < 2_000_000


def test_sdist_builds_a_wheel_on_its_own(sdist, tmp_path):
    path, top, _ = sdist
    with tarfile.open(path) as tar:
        tar.extractall(tmp_path, filter="data")
    wheel = pep517("build_wheel", tmp_path / top, tmp_path, {"VLLM_KBIT_NO_CUDA": "1"})
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        entry_points = z.read("vllm_kbit-0.1.0.dist-info/entry_points.txt").decode()
        metadata = z.read("vllm_kbit-0.1.0.dist-info/METADATA").decode()
    assert {"vllm_kbit/convert.py", "vllm_kbit/quant/plan.py", "vllm_kbit/_build_info.py"} <= names
    assert "[vllm.general_plugins]\nkbit = vllm_kbit:register" in entry_points
    assert "vllm-kbit-convert = vllm_kbit.convert:main" in entry_points
    assert "Requires-Dist: torch\n" in metadata  # no extension: any torch
