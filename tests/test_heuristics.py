"""The per-GPU tables of csrc/dispatch/heuristics.h (read by tests/heuristics_tables.py): the
tables the device choice can return, and the H100 and H200 tables holding the numbers the
planners were tuned with (so either GPU plans as before the tables existed). The choice itself
is checked in C++ (tests/cpp/gemv_plan_test.cu, choose_heuristics). CPU only."""
import heuristics_tables


def test_tables():
    t = heuristics_tables.tables()
    assert set(t) == {"h100", "h200", "generic"}
    h100, h200 = t["h100"], t["h200"]
    # the numbers the sweeps chose (docs/PERFORMANCE.md): the path rule at bits 2..5 ...
    assert h100["wgmma_max_m"] == [4096, 4096, 3072, 1024] and h100["wgmma_short_max_m"] == [1023, 1023, 1023, 512]
    assert h100["dequant_min_m"] == 512
    # ... and the GEMV and wgmma cost models
    assert (h100["gemv_narrow_min_units"], h100["gemv_s4_unit"], h100["gemv_s4_min_units"], h100["gemv_s4_min_bits"],
            h100["gemv_resident_margin"], h100["gemv_fill_percent"]) == (4, 0.9, 8, 3, 0.9, 80)
    assert (h100["wgmma_split_cost128"], h100["wgmma_tall_min_m"], h100["wgmma_tall_k"],
            h100["wgmma_short_chunk"]) == (40, 192, 88, 48)
    # ... and the mma.sync cost model (dispatch/mma_plan.h): config efficiencies, the lone-CTA
    # factor, split write / fill / read-back, the split margin, the configs' M ranges
    assert (h100["mma_eff"], h100["mma_alone"], h100["mma_split_write"], h100["mma_fill"], h100["mma_split_read"],
            h100["mma_split_margin"], h100["mma_small_max_m"], h100["mma_mid_max_m"]) == (
        [0.4, 0.6, 1.0], 0.7, 0.5, 2.0, 2.0, 1.1, 64, 256)
    # ... and the FP8 GEMM's tile choice (dispatch/fp8_plan.h): a tile where its CTAs fill the SMs
    assert (h100["fp8_wide_fill_percent"], h100["fp8_tile128_fill_percent"]) == (100, 100)
    for other in (h200, t["generic"]):  # every table plans as the sweeps chose
        assert {k: v for k, v in h100.items() if k != "name"} == {k: v for k, v in other.items() if k != "name"}
    for row in t.values():  # the path rule's order: wgmma_short_max_m <= wgmma_max_m
        assert all(s <= w for s, w in zip(row["wgmma_short_max_m"], row["wgmma_max_m"]))
