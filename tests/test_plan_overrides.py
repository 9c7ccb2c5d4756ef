"""The Python side of the plan overrides and plan ops (vllm_kbit/ops.py): the `overrides` string
kbit::gemm_path and the plan ops take (parsed by csrc/dispatch/overrides.h, whose C++ checks run
in tests/cpp/gemv_plan_test.cu), and the plans' fields as vllm_kbit.ops names them against the values the C++ returns (a
plan built on the CPU, tests/cpp/plan_fields_test.cu). CPU only (the C++ needs nvcc)."""
import os
import re
import shutil
import subprocess

import pytest

from vllm_kbit import ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plan_overrides_string():
    assert ops.plan_overrides(None) == "" and ops.plan_overrides({}) == ""
    s = ops.plan_overrides({"wgmma.tile_m": 256, "gemv.wide_table": False, "pdl": True, "wgmma.one_per_sm": -1})
    assert s == "wgmma.tile_m=256,gemv.wide_table=0,pdl=1,wgmma.one_per_sm=-1"
    assert ops.plan_overrides("mma.config=1,mma.splits=3") == "mma.config=1,mma.splits=3"


NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)


def _plans_from_cpp(tmp_path):
    """[(family, kernel, [(name, value), ...])] of tests/cpp/plan_fields_test.cu: plans built on
    the CPU, each field as the binding's plan ops return it (csrc/dispatch/plan_fields.h)."""
    exe = tmp_path / "plan_fields_test"
    subprocess.run([NVCC, "-std=c++17", "--expt-relaxed-constexpr", "-I", os.path.join(ROOT, "csrc"), "-o", str(exe),
                    os.path.join(ROOT, "tests", "cpp", "plan_fields_test.cu")], check=True, timeout=300)
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True).stdout
    plans = []
    for line in out.splitlines():
        kind, a, b = line.split()
        if kind == "plan":
            plans.append((a, b, []))
        else:
            plans[-1][2].append((a, int(b)))
    return plans


@pytest.mark.skipif(NVCC is None, reason="needs nvcc")
def test_plan_fields_match_the_binding(tmp_path):
    # each plan's values, wrapped as vllm_kbit.ops wraps the ops' lists, must read back under the
    # names the C++ gives them (GemvPlan gathers clusters1..8), and name the same kernel
    wrap = {"gemv": ops.gemv_plan_from_list, "mma": lambda v: ops.MmaPlan(*v), "wgmma": lambda v: ops.WgmmaPlan(*v),
            "fp8": lambda v: ops.Fp8Plan(*v)}
    plans = _plans_from_cpp(tmp_path)
    assert {f for f, _, _ in plans} == set(wrap), plans
    for family, kernel, fields in plans:
        plan = wrap[family]([v for _, v in fields])
        for name, value in fields:
            if family == "gemv" and name.startswith("clusters"):
                got = plan.clusters[int(name[len("clusters"):]) - 1]
            else:
                got = getattr(plan, name)
            assert got == value, (family, name, got, value, plan)
        assert plan.kernel == kernel, (plan.kernel, kernel)
        names = [n for n, _ in fields if not (family == "gemv" and n.startswith("clusters"))]
        assert tuple(names) + (("clusters",) if family == "gemv" else ()) == plan._fields
    # the plans differ where their shapes do: the comparison sees real values, not one constant
    for family in wrap:
        values = [tuple(v for _, v in f) for fam, _, f in plans if fam == family]
        assert len(set(values)) == len(values) > 1, family
    # the FP8 plan's tile choice on 132 SMs (dispatch/fp8_plan.h): 64 x 128 while 128-token tiles
    # leave SMs idle, then 128 x 128, then the wide 128 x 256; a forced tile is kept; its paths
    fp8 = [ops.Fp8Plan(*[v for _, v in f]) for fam, _, f in plans if fam == "fp8"]
    P = ops.Fp8Path
    assert [p.path for p in fp8] == [P.SIXTEEN_BIT, P.DECODE_FIRST, P.SIXTEEN_BIT, P.FUSED], fp8
    assert [(p.tile_m, p.tile_n) for p in fp8] == [(64, 128), (128, 128), (128, 256), (256, 128)], fp8
    assert [(p.token_tiles, p.column_groups) for p in fp8] == [(1, 32), (8, 32), (18, 16), (2, 2)], fp8


def test_overrides_keys_documented():
    # every key the parser accepts is listed in its header comment
    text = open(os.path.join(ROOT, "csrc", "dispatch", "overrides.h")).read()
    parsed = set(re.findall(r'key == "([\w.]+)"', text))
    documented = set(re.findall(r"^//\s{3}([\w.]+)\s", text, re.M))
    assert parsed and parsed == documented, (parsed ^ documented)
