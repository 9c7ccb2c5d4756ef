"""The GEMV launch plan (csrc/dispatch/gemv_plan.h) on the CPU: tests/cpp/gemv_plan_test.cu, built
with nvcc as host code and run here, checks the choices the H200 measurements made (split-K,
CTA size, x residency for Llama-3-8B / 70B layers and an lm_head) and the invariants every
launch relies on. Skipped where there is no nvcc."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_gemv_plan(tmp_path):
    exe = tmp_path / "gemv_plan_test"
    subprocess.run([NVCC, "-std=c++17", "--expt-relaxed-constexpr", "-I", os.path.join(ROOT, "csrc"), "-o", str(exe),
                    os.path.join(ROOT, "tests", "cpp", "gemv_plan_test.cu")], check=True, timeout=300)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and " 0 failed" in r.stdout, r.stdout[-4000:]
    # every kernel the plans named is one csrc/generate_instantiations.py builds
    sys.path.insert(0, os.path.join(ROOT, "csrc"))
    import generate_instantiations as gen
    keys = [tuple(int(v) for v in line.split()[1:]) for line in r.stdout.splitlines() if line.startswith("key ")]
    assert len(keys) > 20
    for bits, mt, warps, wide, x_smem, slabs in keys:
        assert (mt, warps, bool(wide), bool(x_smem), slabs) in gen.gemv_keys(bits), (bits, mt, warps, wide, x_smem, slabs)
