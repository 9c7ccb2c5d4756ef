"""wgmma kbit GEMM (csrc/wgmma/, Hopper sm_90a) on the GPU, through
torch.ops.kbit.gemm_path(path=4).

The checks (tests/gemm_cases.py): repack + kernel against a float64 matmul of the dequantized
weight, NaN-poisoned outputs, two runs with fresh x each. Split-K runs as a thread-block
cluster reduced in rank order, so every result is bitwise deterministic; the split cases are
rerun with the same x and compared bitwise. Forced split factors cover 1 (no cluster), odd and
uneven chunks and the maximum 8; kbit::wgmma_plan reports what ran. Skips off Hopper or on a
build without 9.0a in TORCH_CUDA_ARCH_LIST.
"""
import pytest
import torch

import gemm_cases
from vllm_kbit import ops
from gemm_cases import OVERRIDES, weight

pytestmark = pytest.mark.gpu

DEQUANT_PATH, WGMMA_PATH = ops.Path.DEQUANT, ops.Path.WGMMA
ALL_M = [17, 31, 32, 33, 48, 64, 127, 128, 255, 256, 512, 1000, 1024, 4096]


if not gemm_cases.have("has_wgmma"):
    pytest.skip("needs an sm_90 GPU and vllm_kbit._C built for 9.0a", allow_module_level=True)


def plan(m, n, k, bits, dtype=torch.float16, splits=0):
    p = ops.wgmma_plan(m, n, k, bits, dtype, splits, gemm_cases.overrides())
    return dict(tile_m=p.tile_m, splits=p.splits, grid=(p.grid_x, p.token_tiles, p.column_groups), cols=p.columns,
                per_sm=p.launch_per_sm, row_split=p.row_split, built_per_sm=p.built_per_sm, groups=p.groups,
                kernel=p.kernel)


def check(m, n, k, bits, dtype, bias=False, tiny=False, x_scale=1.0, splits=0):
    return gemm_cases.check(WGMMA_PATH, m, n, k, bits, dtype, bias, tiny, x_scale, splits,
                            describe=lambda: f"plan={plan(m, n, k, bits, dtype, splits)}")


@pytest.mark.parametrize("m", ALL_M)
def test_all_m_odd_shape(m):
    # N = 4104: a partial 64-column slab and a partial 4-slab CTA; K = 4128 = 32 * 129: the last
    # K-tile holds one 32-block (x zero-filled past K); M tails in the last token tile.
    check(m, 4104, 4128, 4, torch.float16, bias=(m % 2 == 1))


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_bits_dtypes(bits, dtype):
    for m in (17, 33, 64, 200):  # token tiles of 32, 64, 64 and two of 128 (two warpgroups)
        check(m, 4104, 4128, bits, dtype, bias=True)
    check(40, 200, 96, bits, dtype, bias=True)  # tiny N (one CTA, slabs past N) and K = 3 blocks
    check(64, 4096, 4096, bits, dtype)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_small_m_wide_layers(bits, dtype):
    # 8 < M <= 16 on a layer with at least one 64-column slab per SM, forced (the GEMV serves
    # these M, csrc/dispatch/path_rule.h): a 16-token tile with the rows past M zero-filled
    n = 64 * torch.cuda.get_device_properties(0).multi_processor_count + 40
    for m in (9, 13, 16):
        check(m, n, 1056, bits, dtype, bias=(m == 13))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_subnormal_scales(dtype):
    # Every block's absmax is an E4M4 subnormal: the kernel builds scales from the code bits
    # (fp16 code << 6, bf16 code << 3, the constant folded into the codebook); a flushed
    # subnormal would give zeros.
    check(48, 1000, 2080, 4, dtype, tiny=True, x_scale=256.0)


@pytest.mark.parametrize("m", [17, 64, 200])
def test_y_store_paths(m, monkeypatch):
    # Unsplit calls store y through shared memory (stmatrix) and a TMA store where N % 8 == 0,
    # clipped at M and N by the tensor map (N = 1000 and 4104 end in partial slabs), and
    # element by element otherwise (N = 1004); the override wgmma.y_tma=0 forces the element stores.
    # The two must agree bitwise: same sums, same rounding, every element in its place.
    for n, bits, dtype in ((1000, 4, torch.float16), (4104, 3, torch.bfloat16), (1004, 5, torch.float16)):
        outs, (packed, absmax, cb, b) = check(m, n, 4128, bits, dtype, bias=True, splits=1)
        monkeypatch.setitem(OVERRIDES, "wgmma.y_tma", 0)
        for x, y in outs:
            y_scalar = gemm_cases.run(WGMMA_PATH, x, packed, absmax, cb, bits, n, 4128, b, 1)
            assert torch.equal(y.view(torch.int16), y_scalar.view(torch.int16)), \
                f"m={m} n={n} bits={bits} {dtype}: the two y stores differ"
        monkeypatch.delitem(OVERRIDES, "wgmma.y_tma")


@pytest.mark.parametrize("splits", [1, 2, 3, 8, 13])
@pytest.mark.parametrize("m", [24, 64, 100])
def test_forced_splits(splits, m):
    # K = 4128: 65 K-tiles -> chunks of 33/32, 22/22/21, 9 x 7 + 2 (8 splits), 12 x 5 + 5 (13:
    # a non-portable cluster size); N = 1000.
    assert plan(m, 1000, 4128, 3, splits=splits)["splits"] == splits
    for bits, dtype in ((3, torch.float16), (5, torch.bfloat16)):
        check(m, 1000, 4128, bits, dtype, bias=True, splits=splits)


@pytest.mark.parametrize("m", [17, 64, 128])
def test_forced_splits_16(m):
    # the largest cluster (16 CTAs, non-portable): K = 2048, 32 K-tiles in chunks of two
    assert plan(m, 1000, 2048, 4, splits=16)["splits"] == 16
    for bits, dtype in ((4, torch.float16), (2, torch.bfloat16)):
        check(m, 1000, 2048, bits, dtype, bias=True, splits=16)


@pytest.mark.parametrize("m", [16, 33, 64])
def test_wide_ctas(m, monkeypatch):
    # 512-column CTAs (two warpgroups sharing the x tile), forced by the tuning override:
    # N = 1000 leaves the second warpgroup's slabs partly and wholly past N; splits on and off.
    # One CTA per SM, so K=3,4 decode with the wide-row pair table (Cfg::kWideLut).
    monkeypatch.setitem(OVERRIDES, "wgmma.wide", 1)
    assert plan(m, 1000, 4128, 4)["cols"] == 512
    for bits, dtype, splits in ((4, torch.float16, 0), (3, torch.bfloat16, 2), (2, torch.bfloat16, 3),
                                (5, torch.float16, 1)):
        check(m, 1000, 4128, bits, dtype, bias=True, splits=splits)


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tall_tiles(bits, dtype, monkeypatch):
    # 256-token tiles (Cfg::kTall: 128 columns, each warp one row tile of its plane words),
    # forced at every M: one partial tile (17), two (257: one row in the second, 300), four
    # (1000); N = 4104 ends in a partial slab, so the last 128-column CTA has one slab partly
    # and one wholly past N. Both y stores (TMA where N % 8 == 0, else element by element:
    # N = 1004) must agree bitwise. A forced split runs tall CTAs in one cluster along K (the
    # partials reduced through distributed shared memory in rank order: rerun bitwise equal);
    # forced cluster groups fall back to 128-token tiles.
    monkeypatch.setitem(OVERRIDES, "wgmma.tile_m", 256)
    for m in (17, 257, 300, 1000):
        p = plan(m, 4104, 4128, bits, dtype)
        assert (p["tile_m"], p["cols"], p["splits"], p["grid"][1]) == (256, 128, 1, -(-m // 256)), p
        check(m, 4104, 4128, bits, dtype, bias=(m != 300))
    for m, splits in ((300, 3), (200, 2), (1000, 5)):  # 65 K-tiles: chunks of 22 / 22 / 21, 33 / 32, 13
        p = plan(m, 4104, 4128, bits, dtype, splits=splits)
        assert (p["tile_m"], p["cols"], p["splits"], p["groups"]) == (256, 128, splits, 1), p
        outs, (packed, absmax, cb, b) = check(m, 4104, 4128, bits, dtype, bias=(m != 200), splits=splits)
        for x, y in outs:
            y2 = gemm_cases.run(WGMMA_PATH, x, packed, absmax, cb, bits, 4104, 4128, b, splits)
            assert torch.equal(y.view(torch.int16), y2.view(torch.int16)), f"not bitwise deterministic {p}"
    monkeypatch.setitem(OVERRIDES, "wgmma.groups", 2)
    assert (lambda p: (p["tile_m"], p["groups"]))(plan(300, 4104, 4128, bits, dtype)) == (128, 2)
    check(300, 4104, 4128, bits, dtype, bias=True)
    monkeypatch.delitem(OVERRIDES, "wgmma.groups")
    outs, (packed, absmax, cb, b) = check(300, 1000, 4128, bits, dtype, bias=True)
    monkeypatch.setitem(OVERRIDES, "wgmma.y_tma", 0)
    for x, y in outs:
        y_scalar = gemm_cases.run(WGMMA_PATH, x, packed, absmax, cb, bits, 1000, 4128, b, 0)
        assert torch.equal(y.view(torch.int16), y_scalar.view(torch.int16)), f"bits={bits} {dtype}: y stores differ"
    check(300, 1004, 4128, bits, dtype, bias=True)


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("m", [17, 32])
def test_row_split(m, rows, monkeypatch):
    # 32-token tiles run with one warpgroup per CTA or two sharing its slabs (each decodes half
    # of every unit's row tiles), as the plan picks them; both forced here, with splits on and
    # off, every bit width and dtype. (16-token tiles: one; 64 and 128: two; every test above.)
    monkeypatch.setitem(OVERRIDES, "wgmma.row_split", rows)
    assert plan(m, 1000, 4128, 4)["row_split"] == rows
    for bits, dtype, splits in ((2, torch.float16, 0), (3, torch.bfloat16, 3), (4, torch.float16, 1),
                                (5, torch.bfloat16, 8)):
        check(m, 1000, 4128, bits, dtype, bias=(m % 2 == 1), splits=splits)


@pytest.mark.parametrize("one", [0, 1])
@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_one_per_sm(bits, one, monkeypatch):
    # 64-token tiles built for one CTA per SM (producer warpgroup, the wide table at K = 3, 4,
    # eight stages) or for two (one_per_sm in csrc/dispatch/wgmma_plan.h picks): both forced here, at M = 33
    # and 64, split-K off, forced and the plan's, both dtypes.
    monkeypatch.setitem(OVERRIDES, "wgmma.one_per_sm", one)
    for m, dtype, splits in ((33, torch.float16, 0), (64, torch.bfloat16, 3), (64, torch.float16, 1),
                             (48, torch.bfloat16, 0)):
        p = plan(m, 4104, 4128, bits, dtype, splits)
        assert p["tile_m"] == 64 and p["built_per_sm"] == (1 if one else 2), p
        assert p["per_sm"] == 1 or not one, p
        check(m, 4104, 4128, bits, dtype, bias=(m % 2 == 1), splits=splits)


def test_one_per_sm_plan():
    # the plan takes one CTA per SM at MT = 64 where it runs in one wave and gives no SM more
    # K-tiles than two per SM would (Llama-3-8B's qkv, o and down projections), not on the wide
    # layers (H200 measurements: docs/PERFORMANCE.md), nor at K=2; never at other tiles
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        for n, k in ((4096, 14336), (4096, 4096), (6144, 4096)):
            assert plan(64, n, k, 4)["built_per_sm"] == 1, (n, k)
        for n, k in ((57344, 8192), (8192, 28672)):
            assert plan(64, n, k, 4)["built_per_sm"] == 2, (n, k)
        assert plan(64, 4096, 4096, 3)["built_per_sm"] == 1
    # K=2: two CTAs per SM already hold eight stages (one_per_sm_deeper)
    assert plan(64, 4096, 4096, 2)["built_per_sm"] == 2
    assert plan(32, 4096, 4096, 4)["built_per_sm"] == 2 and plan(16, 4096, 4096, 4)["built_per_sm"] == 2
    assert plan(200, 4096, 4096, 4)["built_per_sm"] == 1


@pytest.mark.parametrize("one", [-1, 0])
@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("m", [40, 100, 200])
def test_cluster_groups(m, groups, one, monkeypatch):
    # Split-K over several clusters whose sums meet in the global workspace (choose_groups),
    # forced at 64- and 128-token tiles, with the producer warpgroup (128-token tiles, and 64
    # where one_per_sm takes one CTA per SM) and without it (wgmma.one_per_sm=0 at 64), clusters
    # of 1, 2 and 3 CTAs, every bit width and dtype. Rerun on the same x and compared bitwise:
    # the last cluster to arrive adds the groups in group order, whichever cluster it is (with
    # three groups that order is what keeps the bits).
    monkeypatch.setitem(OVERRIDES, "wgmma.groups", groups)
    monkeypatch.setitem(OVERRIDES, "wgmma.one_per_sm", one)
    n, k = 1000, 4128  # 65 K-tiles: uneven chunks
    for bits, dtype, splits in ((2, torch.float16, 1), (3, torch.bfloat16, 2), (4, torch.float16, 3),
                                (5, torch.bfloat16, 2)):
        p = plan(m, n, k, bits, dtype, splits)
        assert p["groups"] == groups and p["splits"] == splits and p["grid"][0] == splits * groups, p
        assert one == -1 or m > 64 or p["built_per_sm"] == 2, p
        outs, (packed, absmax, cb, b) = check(m, n, k, bits, dtype, bias=True, splits=splits)
        for x, y in outs:
            y2 = gemm_cases.run(WGMMA_PATH, x, packed, absmax, cb, bits, n, k, b, splits)
            assert torch.equal(y.view(torch.int16), y2.view(torch.int16)), f"not bitwise deterministic {p}"


@pytest.mark.parametrize("zeroed", ["1", "0"])
def test_cluster_groups_plan(zeroed, monkeypatch):
    # 4096 columns at 129..256 tokens are 32 tiles of 128 tokens; clusters of 4 would fill 128
    # SMs, but the H200 holds 30 of them, so the plan runs the long-K layer (4096x14336) as two
    # clusters of 2 per tile; not 4096x4096 (measured slower so), nor where clusters of 4 fit
    # (3584 columns: 28 tiles), nor wide layers, nor below 128-token tiles, nor with a forced
    # split or wgmma.groups=1. The plan's picks are checked against float64 at every bit
    # width and dtype and in a CUDA graph, with the device's zeroed counters (left zero by each
    # launch) and with wgmma.zeroed_counters=0 (a memset of counters in the workspace first).
    monkeypatch.setitem(OVERRIDES, "wgmma.zeroed_counters", int(zeroed))
    if torch.cuda.get_device_properties(0).multi_processor_count != 132:
        pytest.skip("the plan's picks below are the H200's (132 SMs)")
    n, k = 4096, 14336
    for m in (256, 200, 129):
        p = plan(m, n, k, 4)
        assert p["groups"] == 2 and p["splits"] == 2 and p["grid"][0] == 4, (m, p)
    assert plan(256, 4096, 4096, 4)["groups"] == 1 and plan(256, 3584, 18944, 4)["groups"] == 1
    with monkeypatch.context() as mp:  # the wide layer at 128-token tiles (the plan takes 256 there)
        mp.setitem(OVERRIDES, "wgmma.tile_m", 128)
        assert plan(256, 28672, 4096, 4)["groups"] == 1
    assert plan(64, n, k, 4)["groups"] == 1
    assert plan(256, n, k, 4, splits=3)["groups"] == 1
    for bits, dtype in ((2, torch.bfloat16), (3, torch.float16), (4, torch.bfloat16), (5, torch.float16)):
        m = 200 if bits % 2 else 256  # two token tiles either way (a partial second one at 200)
        assert plan(m, n, k, bits, dtype)["groups"] == 2
        outs, (packed, absmax, cb, b) = check(m, n, k, bits, dtype, bias=(bits % 2 == 0))
        x, y = outs[0]
        y2 = gemm_cases.run(WGMMA_PATH, x, packed, absmax, cb, bits, n, k, b)
        assert torch.equal(y.view(torch.int16), y2.view(torch.int16)), "not bitwise deterministic"
    gemm_cases.check_graph_capture(WGMMA_PATH, m=256, n=n, k=k, bits=4)
    monkeypatch.setitem(OVERRIDES, "wgmma.groups", 1)
    assert plan(256, n, k, 4)["groups"] == 1


def test_row_split_plan(monkeypatch):
    # one warpgroup at 16 tokens; two at 64 and 128 (forced at M = 200, where the plan takes the
    # 256-token tile, whose two warpgroups are fixed); at 32 where a CTA runs <= 48 K-tiles
    # (wgmma_short_chunk)
    assert plan(16, 57344, 8192, 4)["row_split"] == 1 and plan(9, 1000, 4128, 4)["row_split"] == 1
    assert plan(64, 57344, 8192, 4)["row_split"] == 2
    with monkeypatch.context() as mp:
        mp.setitem(OVERRIDES, "wgmma.tile_m", 128)
        assert plan(200, 57344, 8192, 4)["row_split"] == 2
    p_short = plan(32, 4096, 14336, 4)
    assert p_short["row_split"] == (2 if -(-224 // p_short["splits"]) <= 48 else 1), p_short
    p_long = plan(32, 57344, 8192, 4)
    assert p_long["row_split"] == (2 if -(-128 // p_long["splits"]) <= 48 else 1), p_long


def test_plans_use_split_k_and_not():
    assert plan(64, 4096, 4096, 4)["splits"] > 1          # 16 CTAs without splitting
    assert plan(64, 57344, 8192, 4)["splits"] == 1        # 224 CTAs already
    # clusters past 8 CTAs (non-portable) only where each CTA keeps >= 16 K-tiles (the pick
    # past 8 is the H200's: 12 of 224 K-tiles)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert 8 < plan(32, 4096, 14336, 4)["splits"] <= 14
    assert plan(64, 4096, 4096, 4)["splits"] <= 8
    assert plan(64, 57344, 8192, 4)["cols"] == 256  # 512-column CTAs only when forced
    assert plan(16, 57344, 8192, 4)["cols"] == 256
    assert plan(17, 4096, 4096, 4)["tile_m"] == 32 and plan(16, 4096, 4096, 4)["tile_m"] == 16
    assert plan(160, 4096, 4096, 4)["tile_m"] == 128 and plan(160, 4096, 4096, 4)["grid"][1] == 2


def test_split_cost_at_tile_128(monkeypatch):
    # At MT = 128 a split CTA pays its 128 KB reduction (wgmma_split_cost128): 4096x14336 at M = 512
    # (64 tiles) still splits, while on the H200's 132 SMs 28672x4096 at M = 576 (560 tiles) and
    # 4096x14336 at M = 704 (96 tiles) run unsplit, which a cost of 0 (the plan before) did not.
    # (128-token tiles forced: the plan takes 256-token ones at some of these, test_tall_pick.)
    monkeypatch.setitem(OVERRIDES, "wgmma.tile_m", 128)
    assert plan(512, 4096, 14336, 4)["splits"] > 1
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        assert plan(576, 28672, 4096, 4)["splits"] == 1 and plan(704, 4096, 14336, 4)["splits"] == 1
        monkeypatch.setitem(OVERRIDES, "wgmma.split_cost", 0)
        assert plan(576, 28672, 4096, 4)["splits"] > 1 and plan(704, 4096, 14336, 4)["splits"] > 1


def test_tall_pick():
    # plan_t takes 256-token tiles where choose_tall's cost beats the 128-token plan's: never
    # below 192 rows; unsplit on wide layers from one tile at M = 192 and at M ~ 1000; split along
    # K (clusters of 2 or 3) where too few tall CTAs would leave SMs idle (4096x4096 at M = 256:
    # 32 tall CTAs, 6144x4096 48, 4096x4096 and 4096x14336 at M = 512: 64); not where the
    # 128-token plan's cluster groups cost less (4096x14336 at M = 256)
    # (tests/test_wgmma_plan.py replays the choice against measured times).
    for n, k in ((4096, 4096), (28672, 4096), (57344, 8192)):
        assert plan(160, n, k, 4)["tile_m"] == 128
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        tile_split = lambda m, n, k: (lambda p: (p["tile_m"], p["splits"], p["groups"]))(plan(m, n, k, 4))
        assert tile_split(256, 4096, 4096) == (256, 3, 1) and tile_split(256, 6144, 4096) == (256, 2, 1)
        assert tile_split(256, 4096, 14336) == (128, 2, 2)
        assert tile_split(192, 28672, 4096) == (256, 1, 1) and tile_split(256, 57344, 8192) == (256, 1, 1)
        assert tile_split(512, 4096, 4096) == (256, 2, 1) and tile_split(512, 4096, 14336) == (256, 2, 1)
        for n, k in ((4096, 4096), (28672, 4096), (4096, 14336), (57344, 8192)):
            p = plan(1000, n, k, 4)
            assert (p["tile_m"], p["cols"], p["splits"]) == (256, 128, 1), (n, k, p)
        # above wgmma_short_max_m (where the tile picks kbit::gemm's path) no tall splits: the
        # plan there is the unsplit model auto_path's rule was measured with
        assert tile_split(1200, 4096, 14336)[0] == 128
        assert torch.ops.kbit.auto_path(1200, 4096, 14336, 4, torch.float16) == DEQUANT_PATH
        with pytest.MonkeyPatch.context() as mp:  # the knob for A/B: the unsplit tall tiles only
            mp.setitem(OVERRIDES, "wgmma.tall_split", 0)
            assert tile_split(256, 4096, 4096)[0] == 128 and tile_split(512, 4096, 14336)[0] == 128
    assert plan(1000, 28672, 4096, 4, splits=2)["tile_m"] == 128  # a forced split keeps 128


def test_spread_launch(monkeypatch):
    # A grid of at most one CTA per SM is launched with half an SM's shared memory, so the
    # cluster scheduler cannot pack two CTAs on one SM (csrc/dispatch/wgmma_plan.h, fits_spread); results
    # must not depend on it. Portable cluster sizes only: with K = 14336 the plan would take
    # a packed 12-CTA cluster instead.
    monkeypatch.setitem(OVERRIDES, "wgmma.max_splits", 8)
    monkeypatch.setitem(OVERRIDES, "wgmma.one_per_sm", 0)  # the 64-token tile built for two CTAs per SM
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = 64 * 4 * (sms // 8)  # sms // 8 column groups: eight K-splits fill the SMs once
    p = plan(64, n, 14336, 4)
    assert p["splits"] * p["grid"][2] <= sms and p["per_sm"] == 1, p
    check(64, n, 14336, 4, torch.float16, bias=True)
    monkeypatch.setitem(OVERRIDES, "wgmma.spread", 0)
    assert plan(64, n, 14336, 4)["per_sm"] > 1
    check(64, n, 14336, 4, torch.bfloat16, bias=True)


@pytest.mark.parametrize("m,n,k,bits,dtype", [
    (64, 4096, 4096, 4, torch.float16),      # split-K
    (33, 4104, 4128, 3, torch.bfloat16),     # split-K, odd K-tiles
    (256, 4104, 4128, 5, torch.float16),
    (17, 57344, 1024, 2, torch.bfloat16),
])
def test_deterministic(m, n, k, bits, dtype):
    outs, (packed, absmax, cb, b) = check(m, n, k, bits, dtype, bias=True)
    for x, y in outs:
        y2 = gemm_cases.run(WGMMA_PATH, x, packed, absmax, cb, bits, n, k, b)
        assert torch.equal(y.view(torch.int16), y2.view(torch.int16)), "not bitwise deterministic"


@pytest.mark.parametrize("bits,ms", [
    (4, (17, 64, 1023, 1040, 1500, 3072, 3073)),  # 1040: a last 256-token tile of 16 rows
    (5, (17, 512, 520, 1000, 1024, 1025)),         # 520: likewise (8 rows)
])
def test_auto_path_follows_the_plan(bits, ms):
    # kbit::gemm's own dispatch gives the bits of the path auto_path names, and auto_path names
    # wgmma above the GEMV limit up to wgmma_short_max_m, then up to wgmma_max_m only where the
    # wgmma plan takes 256-token tiles (else dequantize + cuBLAS, which gives other bits)
    n, k = 4104, 4128
    packed, absmax, cb, w = weight(n, k, bits)
    lo, short, hi = (getattr(torch.ops.kbit, f)(bits) for f in ("gemv_max_m", "wgmma_short_max_m", "wgmma_max_m"))
    assert lo < short < hi and hi + 1 == ms[-1]
    above = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        tall = m <= hi and plan(m, n, k, bits, torch.bfloat16)["tile_m"] == 256
        expect = WGMMA_PATH if m <= short or tall else DEQUANT_PATH
        assert torch.ops.kbit.auto_path(m, n, k, bits, torch.bfloat16) == expect, m
        y_auto = torch.ops.kbit.gemm(x, packed, absmax, cb, bits, n, k, None)
        y_named = gemm_cases.run(expect, x, packed, absmax, cb, bits, n, k)
        assert torch.equal(y_auto, y_named), f"m={m}"
        if m > short:
            above.append(expect)
            other_path = {WGMMA_PATH: DEQUANT_PATH, DEQUANT_PATH: WGMMA_PATH}[expect]
            other = gemm_cases.run(other_path, x, packed, absmax, cb, bits, n, k)
            assert not torch.equal(y_auto, other), f"m={m}: both paths give the same bits: the test cannot tell"
    assert set(above) == {WGMMA_PATH, DEQUANT_PATH}, above  # both outcomes above the short limit


def test_cuda_graph_capture():
    gemm_cases.check_graph_capture(WGMMA_PATH, m=64, n=4096, k=4096, bits=4)  # split-K cluster launch inside the graph
