"""The wgmma kernel's plan on the CPU: tests/cpp/wgmma_splits_test.cu replays it (csrc/dispatch/wgmma_plan.h:
tile_m, choose_splits through plan_split, one_per_sm) with the H200's occupancy on every case of the
forced split sweeps in tests/data (bench_gemm.py --sweep-splits, K=4: M = 256..1000 at
128-token tiles; M = 32..64 at 32- and 64-token tiles, the 64-token tile built for two CTAs per SM
and for one, recorded with the knob KBIT_WGMMA_ONE=0 / 1), and the pick (split, CTAs per SM) must run within 4% of the
fastest forced configuration measured there (back-to-back timings of one configuration on the big
layers differ by up to a few %). The cluster groups plan_t adds at 128-token tiles (choose_groups)
are pinned on the layers they were measured on. Skipped without nvcc."""
import collections
import json
import os
import shutil
import subprocess

import pytest

import heuristics_tables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")  # the sweeps' timings (tests/data/README.md)
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
# the 8B layers the split cost was fitted to, Llama-3-70B layers measured after the fit, and the
# 32- / 64-token tiles (a later file's timing of the same configuration replaces an earlier one's)
SWEEPS = ["wgmma_splits_8b_m256_1000.json", "wgmma_splits_8b_m320_960.json", "wgmma_splits_70b.json",
          "wgmma_splits_m32_64.json", "wgmma_splits_m32_64_one_per_sm.json"]
# the sweep whose "auto" runs without knobs (the device's own pick) ran the current plan on calls
# short enough to time stably: the 8B sweeps' "auto" is a plan without wgmma_split_cost128, the first
# m32_64 sweep's a plan without one_per_sm, and on the 70B sweep's compute-bound calls (57344x8192,
# M >= 576) "auto", timed first, ran 7-10% faster than the same split forced right after it, the
# clock dropping under sustained load (bench_gemm.py's note)
AUTO_SWEEPS = ["wgmma_splits_m32_64_one_per_sm.json"]


def built_per_sm(r):
    """CTAs per SM the kernel of a sweep record was built for: one at 128-token tiles, and at 64
    with the knob KBIT_WGMMA_ONE=1 (its name in the records); two below."""
    return 1 if r["m"] > 64 or (r["m"] > 32 and r.get("knobs", {}).get("KBIT_WGMMA_ONE") == "1") else 2


def sweep_times(auto=False):
    """{(n, k, m): {(splits, CTAs per SM): us}} of the forced runs; with auto, {(n, k, m): us} of
    the plan's own pick timed beside them without knobs (the sweeps that recorded it)."""
    cases = collections.defaultdict(dict)
    for name in AUTO_SWEEPS if auto else SWEEPS:
        with open(os.path.join(DATA, name)) as f:
            for r in json.load(f)["results"]:
                tag, case = r["method"].rsplit("-", 1)[-1], (r["n"], r["k"], r["m"])
                if auto and tag == "auto" and not r.get("knobs"):
                    cases[case] = r["us"]
                elif not auto and tag.startswith("s"):
                    cases[case][(int(tag[1:]), built_per_sm(r))] = r["us"]
    return cases


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    if NVCC is None:
        pytest.skip("needs nvcc")
    exe = tmp_path_factory.mktemp("wgmma_plan") / "wgmma_splits_test"
    subprocess.run([NVCC, "-std=c++17", "--expt-relaxed-constexpr", "-I", os.path.join(ROOT, "csrc"), "-o", str(exe),
                    os.path.join(ROOT, "tests", "cpp", "wgmma_splits_test.cu")], check=True, timeout=600)

    def run(cases, cost=None, groups=False, tall=False, overrides=()):
        stdin = "".join(f"{n} {k} {m}\n" for n, k, m in cases)
        args = list(overrides) + ([f"wgmma.split_cost={cost}"] if cost is not None else [])
        r = subprocess.run([str(exe)] + args, input=stdin, capture_output=True, text=True, timeout=60, check=True)
        # (n, k, m) -> (splits, CTAs per SM), or with groups=True (cluster groups, CTAs per cluster),
        # or with tall=True the split of the 256-token tiles plan_t takes (0: 128-token tiles)
        if tall:
            return {tuple(int(v) for v in line.split()[:3]): int(line.split()[7]) for line in r.stdout.splitlines()}
        cols = slice(5, 7) if groups else slice(3, 5)
        return {tuple(int(v) for v in line.split()[:3]): tuple(int(v) for v in line.split()[cols])
                for line in r.stdout.splitlines()}
    return run


def test_split_pick_is_near_the_fastest_measured(replay):
    cases = sweep_times()
    assert len(cases) >= 55 + 24 and min(m for _, _, m in cases) == 32
    # both builds of the 64-token tile were swept
    assert {cps for (_, _, m), t in cases.items() if 32 < m <= 64 for _, cps in t} == {1, 2}
    picks = replay(cases)
    slow = {c: (picks[c], t[picks[c]] / min(t.values())) for c, t in cases.items() if t[picks[c]] > 1.04 * min(t.values())}
    assert not slow, slow


def test_split_cost_zero_is_the_old_plan(replay):
    # the plan before wgmma_split_cost128 took a split on 28672x4096 at M = 448..768 that ran 9-14% slower
    cases = sweep_times()
    picks = replay(cases, cost=0)
    t = cases[(28672, 4096, 704)]
    assert picks[(28672, 4096, 704)][0] > 1 and t[picks[(28672, 4096, 704)]] > 1.05 * t[(1, 1)]


def test_replay_models_the_device_plan(replay):
    # at M = 48 and 64 the device's own pick ran as fast as the forced configuration the replay picks
    # (within 3%): the replay's occupancy tables, tile and CTAs per SM are the device's
    auto = sweep_times(auto=True)
    cases = sweep_times()
    assert len(auto) >= 16
    picks = replay(auto)
    off = {c: (picks[c], us / cases[c][picks[c]]) for c, us in auto.items() if abs(us / cases[c][picks[c]] - 1) > 0.03}
    assert not off, off


def test_cluster_groups_picks(replay):
    # plan_t splits K over cluster groups (choose_groups) at 128-token tiles where the clusters
    # that would fill the SMs do not fit: the H200 holds 30 clusters of 4, so 4096x14336 at
    # 129..256 tokens (32 tiles) runs as two clusters of 2 a tile instead of clusters of 3 on 96
    # SMs (measured faster on the H200; docs/DESIGN.md, cluster groups). Not 4096x4096 (measured
    # slower grouped), nor where clusters fit (3584 columns: 28 tiles), nor wide layers, nor
    # 64-token tiles.
    cases = [(4096, 14336, m) for m in (129, 200, 256)] + [
        (4096, 4096, 256), (3584, 18944, 256), (28672, 4096, 256), (6144, 4096, 256), (8192, 28672, 256),
        (4096, 14336, 64), (4096, 14336, 512)]
    picks = replay(cases, groups=True)
    for m in (129, 200, 256):
        assert picks[(4096, 14336, m)] == (2, 2), (m, picks[(4096, 14336, m)])
    for c in cases[3:]:
        assert picks[c][0] == 1, (c, picks[c])


TALL_SWEEP = "wgmma_tall_tiles.json"
# the two sweeps below timed unsplit 256-token tiles only: their replays run choose_tall without
# the tall splits (plan override wgmma.tall_split=0), which test_tall_split_replay covers
UNSPLIT = ("wgmma.tall_split=0",)


def tall_times(name=TALL_SWEEP, tile=lambda r: r["knobs"].get("KBIT_WGMMA_TILE_M", "auto")):
    """{(n, k, m): {tile: us}} of a results file whose records `tile` labels ("128", "256", or
    "auto" in the tall sweep; None: not a tile timing), each the mean of its runs."""
    with open(os.path.join(DATA, name)) as f:
        recs = json.load(f)["results"]
    runs = collections.defaultdict(lambda: collections.defaultdict(list))
    for r in recs:
        if tile(r) is not None:
            runs[(r["n"], r["k"], r["m"])][tile(r)].append(r["us"])
    return {c: {t: sum(v) / len(v) for t, v in d.items()} for c, d in runs.items()}


def slow_tall_picks(cases, picks):
    """{case: (pick, time / faster time)} where the replay's tile choice ran over 4% slower than
    the faster of the two forced tiles."""
    slow = {}
    for c, t in cases.items():
        got = t["256"] if picks[c] else t["128"]
        if got > 1.04 * min(t["128"], t["256"]):
            slow[c] = (picks[c], round(got / min(t["128"], t["256"]), 3))
    return slow


def test_tall_pick_replay(replay):
    # choose_tall (256-token tiles, unsplit, or the 128-token plan) replayed on every case of a
    # sweep that timed both forced (M = 320..1000, eight layer shapes, K=4): the pick must run
    # within 4% of the faster of the two, except where it keeps the 128-token plan (the plan
    # before the tall tiles) in the cases listed, whose tall tiles ran 5-16% faster
    missed = {(6144, 4096, 320), (4096, 4096, 576), (4096, 14336, 576), (10240, 8192, 576), (4096, 14336, 640)}
    cases = tall_times()
    assert len(cases) == 72
    picks = replay(cases, tall=True, overrides=UNSPLIT)
    assert sum(picks.values()) >= 30  # it does take them
    slow = {c: v for c, v in slow_tall_picks(cases, picks).items() if not (c in missed and not picks[c])}
    assert not slow, slow


ONE_TILE_PROBE = "wgmma_tall_one_tile.json"


def test_tall_one_tile_replay(replay):
    # one 256-token tile at M = 160..256 (both tiles forced, eight shapes, K=4; the probe that set
    # wgmma_tall_min_m = 192): the pick must run within 4% of the faster of the two, except 10240x8192 at
    # M = 160, below the limit, whose tall tile ran 9% faster (the two widest layers lost 9-14%
    # there with theirs)
    cases = tall_times(ONE_TILE_PROBE, lambda r: {"gemm_t128": "128", "gemm_t256": "256"}.get(r["config"]))
    assert len(cases) == 32
    picks = replay(cases, tall=True, overrides=UNSPLIT)
    min_m = heuristics_tables.table("h200")["wgmma_tall_min_m"]  # the replay's table
    assert sum(picks.values()) >= 6 and not any(picks[c] for c in cases if c[2] < min_m)
    slow = slow_tall_picks(cases, picks)
    assert set(slow) == {(10240, 8192, 160)}, slow


TALL_SPLIT_SWEEP = "wgmma_tall_splits.json"


def test_tall_split_replay(replay):
    # choose_tall with split tall CTAs (clusters of up to wgmma_tall_max_splits along K) replayed on a
    # sweep of 256-token tiles forced with s = 1, 2, 3, 4, 6, 8 beside the plan before them (eight
    # shapes, M = 192..1000, K=4, two rounds): the pick must run within 4% of the fastest measured
    # configuration, except 4096x4096 at M = 384 (a second tile of 128 rows, 5% slower). Where the
    # pick is the configuration the old plan ran, its time is the old plan's (timed first in each
    # round, it ran up to 12% faster than the same configuration forced after it on the compute-
    # bound 57344x8192 at M >= 512: bench_gemm.py's note on sustained load)
    with open(os.path.join(DATA, TALL_SPLIT_SWEEP)) as f:
        recs = json.load(f)["results"]
    times, old = collections.defaultdict(dict), {}
    for r in recs:
        case = (r["n"], r["k"], r["m"])
        if r["config"] == "planinfo":
            old[case] = (r["us"][0], r["us"][1])  # (tile_m, splits) of the plan before
        else:
            times[case][r["config"]] = sum(r["us"]) / len(r["us"])
    assert len(times) == 56
    picks = replay(times, tall=True)
    assert sum(1 for v in picks.values() if v > 1) >= 12  # it does split them
    slow = {}
    for c, t in times.items():
        s = picks[c]
        if (s == 0 and old[c][0] == 128) or (s > 0 and (256, s) == old[c]):
            got = t["plan"]  # the configuration the old plan ran
        else:
            assert s > 0, (c, "a 128-token pick where only the 256-token tile was timed")
            got = t[f"t{s}"]
        if got > 1.04 * min(t.values()):
            slow[c] = (s, round(got / min(t.values()), 3))
    assert set(slow) == {(4096, 4096, 384)}, slow
