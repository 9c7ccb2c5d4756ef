"""The Python side of the plan overrides and plan ops (vllm_kbit/ops.py): the `overrides` string
kbit::gemm_path and the plan ops take (parsed by csrc/dispatch/overrides.h, whose C++ checks run
in tests/cpp/gemv_plan_test.cu), and the field names of the plans' lists. CPU only."""
import re

import pytest

from vllm_kbit import ops


def test_plan_overrides_string():
    assert ops.plan_overrides(None) == "" and ops.plan_overrides({}) == ""
    s = ops.plan_overrides({"wgmma.tile_m": 256, "gemv.wide_table": False, "pdl": True, "wgmma.one_per_sm": -1})
    assert s == "wgmma.tile_m=256,gemv.wide_table=0,pdl=1,wgmma.one_per_sm=-1"
    assert ops.plan_overrides("mma.config=1,mma.splits=3") == "mma.config=1,mma.splits=3"


@pytest.mark.parametrize("fields,header_field", [(ops.GEMV_PLAN_FIELDS, "gemv_plan"),
                                                 (ops.MMA_PLAN_FIELDS, "mma_plan"),
                                                 (ops.WGMMA_PLAN_FIELDS, "wgmma_plan")])
def test_plan_fields_match_the_binding(fields, header_field):
    # csrc/binding.cpp documents each plan op's field order in one comment; the named tuples
    # must list the same names in the same order
    import os
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "binding.cpp")).read()
    block = text[text.index("// Plan ops' fields, in order:"):text.index("TORCH_LIBRARY_FRAGMENT(kbit, m)")]
    entry = re.search(rf"//\s+{header_field}:\s+(.*?)(?=//\s+\w+_plan:|$)", block, re.S).group(1)
    names = [re.sub(r"\(.*", "", n).strip().split("[")[0] for n in re.sub(r"\n\s*//\s*", " ", entry).split(",")]
    names = [n.split()[0] for n in names if n.strip()]
    if header_field == "gemv_plan":  # then clusters[1..8], gathered into one tuple field
        names = names[:3] + ["clusters"]
    assert tuple(names) == fields, names


def test_overrides_keys_documented():
    # every key the parser accepts is listed in its header comment
    import os
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "dispatch",
                             "overrides.h")).read()
    parsed = set(re.findall(r'key == "([\w.]+)"', text))
    documented = set(re.findall(r"^//\s{3}([\w.]+)\s", text, re.M))
    assert parsed and parsed == documented, (parsed ^ documented)
