#!/usr/bin/env bash
# Same-call A/B of compile-time probe flags (one device call): for each NAME=FLAGS spec, build
# the extension with KBIT_NVCC_FLAGS=FLAGS (an empty FLAGS is the default build) and run
# `benchmarks/bench_decode.py ARGS --out $OUT/NAME`; with ROUNDS=2 the builds alternate twice.
# Then scripts/ab_summary.py prints the per-layer table (first spec = baseline). The last
# spec's build stays installed: end with the default build ("name=") if later steps need it.
#   scripts/ab_builds.sh "base=-DKBIT_GEMV_DEV_SCALEW=0" "new=" -- --ms 12,16 --bits 4 --per-shape --no-baselines
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
specs=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do specs+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
export PYTHONUNBUFFERED=1
labels=()
for round in $(seq 1 "${ROUNDS:-1}"); do
    for spec in "${specs[@]}"; do
        name=${spec%%=*} flags=${spec#*=}
        t0=$(date +%s)
        KBIT_NVCC_FLAGS="$flags" TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS="${MAX_JOBS:-16}" \
            python3 -m pip install --no-build-isolation --no-deps --no-index -e . >"$OUT/build_$name.log" 2>&1 \
            || { echo "build $name failed"; grep -E "error" "$OUT/build_$name.log" | head -20; exit 1; }
        echo "=== $name ($flags) built in $(( $(date +%s) - t0 )) s, round $round"
        [ "$round" = 1 ] && rm -rf "${OUT:?}/$name"  # ab_summary.py averages every run in the folder
        mkdir -p "$OUT/$name"
        python3 benchmarks/bench_decode.py "$@" --out "$OUT/$name" > "$OUT/$name/round$round.log" 2>&1 || { tail -5 "$OUT/$name/round$round.log"; exit 1; }
        [ "$round" = 1 ] && labels+=("$name=$OUT/$name")
    done
done
python3 scripts/ab_summary.py "${labels[@]}" --what all
