#!/usr/bin/env bash
# Same-machine A/B of two or more source trees (say, main and a branch checked out side by side):
# for each NAME=DIR spec, build DIR's extension into this environment and run its
# `benchmarks/bench_decode.py ARGS --out $OUT/NAME`; with ROUNDS=2 the builds alternate twice,
# so clock and thermal drift fall on both. Then scripts/ab_summary.py prints the per-layer table
# (first spec = baseline). The last spec's build stays installed.
#
#   git worktree add ../base main
#   scripts/ab_builds.sh base=../base new=. -- --ms 1,16,64 --bits 4 --per-shape --no-baselines
#
# A/B of plan choices needs no second build: bench_decode.py --overrides (csrc/dispatch/overrides.h).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
specs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do specs+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#specs[@]} -ge 2 ] || { echo "usage: scripts/ab_builds.sh NAME=DIR NAME=DIR [...] -- BENCH_DECODE_ARGS"; exit 2; }
export PYTHONUNBUFFERED=1
labels=()
for round in $(seq 1 "${ROUNDS:-1}"); do
    for spec in "${specs[@]}"; do
        name=${spec%%=*} dir=${spec#*=}
        t0=$(date +%s)
        TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS="${MAX_JOBS:-16}" \
            python3 -m pip install --no-build-isolation --no-deps --no-index -e "$dir" >"$OUT/build_$name.log" 2>&1 \
            || { echo "build $name failed"; grep -E "error" "$OUT/build_$name.log" | head -20; exit 1; }
        echo "=== $name ($dir) built in $(( $(date +%s) - t0 )) s, round $round"
        [ "$round" = 1 ] && rm -rf "${OUT:?}/$name"  # ab_summary.py averages every run in the folder
        mkdir -p "$OUT/$name"
        (cd "$dir" && python3 benchmarks/bench_decode.py "$@" --out "$OUT/$name") > "$OUT/$name/round$round.log" 2>&1 \
            || { tail -5 "$OUT/$name/round$round.log"; exit 1; }
        [ "$round" = 1 ] && labels+=("$name=$OUT/$name")
    done
done
python3 scripts/ab_summary.py "${labels[@]}" --what all
