#!/usr/bin/env bash
# On a GPU machine: build the extension, run the GPU tests,
# optionally the sanitizers and the GEMM benchmark. Logs go to $OUT (the device tool's
# result folder; ./out when run by hand).
#
#   scripts/gpu_check.sh                          build + the whole test suite (KBIT_TESTS=... to pick)
#   scripts/gpu_check.sh --sanitize               + compute-sanitizer memcheck / racecheck
#   scripts/gpu_check.sh --no-tests --bench ...   build + benchmarks/bench_gemm.py ...
#       (with .vllm-bundle carried, its activate.sh is sourced first for Marlin / Machete)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
TESTS=1 SANITIZE=0 BENCH=0
BENCH_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --no-tests) TESTS=0 ;;
        --sanitize) SANITIZE=1 ;;
        --bench) BENCH=1; shift; BENCH_ARGS=("$@"); break ;;
        *) echo "gpu_check: unknown argument $1"; exit 2 ;;
    esac
    shift
done
export PYTHONUNBUFFERED=1
status=0
step() { echo; echo "=== $* ($(date +%T))"; }

step "device"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader || true

step "build"  # ninja, 16 parallel nvcc jobs; a warm machine rebuilds only what changed
t0=$(date +%s)
TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0a}" MAX_JOBS="${MAX_JOBS:-16}" \
    python3 -m pip install --no-build-isolation --no-deps --no-index -e . >"$OUT/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - t0 )) s"
if [ $rc -ne 0 ]; then
    grep -E "error|Error" "$OUT/build.log" | head -40
    tail -20 "$OUT/build.log"
    exit 1
fi
python3 -c "from vllm_kbit import ops; assert ops.HAS_CUDA_KERNELS, 'extension not loaded'; print('vllm_kbit._C loaded')" \
    || exit 1

if [ -f .vllm-bundle/activate.sh ]; then  # vLLM (and Marlin / Machete) for the plugin tests and benchmarks
    # shellcheck disable=SC1091
    source .vllm-bundle/activate.sh >/dev/null
fi

if [ $TESTS -eq 1 ]; then
    step "tests (${KBIT_TESTS:-tests})"
    # shellcheck disable=SC2086
    timeout "${KBIT_TEST_TIMEOUT:-900}" python3 -m pytest -q -p no:cacheprovider -rf --durations=8 -s \
        ${KBIT_TESTS:-tests} 2>&1 | grep -v -E "^(\(EngineCore|INFO|WARNING)" | tee "$OUT/tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ $SANITIZE -eq 1 ]; then
    # script[+OVERRIDES]: sanitize_small again with the GEMV's x resident in every launch
    for spec in sanitize_small sanitize_small+gemv.slabs=4 sanitize_small+gemv.slabs=15 sanitize_small+gemv.slabs=16 sanitize_mma sanitize_wgmma sanitize_fp8 sanitize_moe; do
        script=${spec%%+*}
        args=()
        [ "$spec" != "$script" ] && args=("${spec#*+}")
        for tool in memcheck racecheck; do
            step "compute-sanitizer $tool $spec (kbit kernels only)"
            timeout 600 compute-sanitizer --tool "$tool" --kernel-name kns=kbit --error-exitcode 3 \
                python3 "tests/$script.py" ${args[@]+"${args[@]}"} 2>&1 | tail -8 | tee "$OUT/${spec//[+=.]/_}_$tool.log"
            [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
        done
    done
fi

if [ $BENCH -eq 1 ]; then
    step "bench"
    timeout "${KBIT_BENCH_TIMEOUT:-1200}" python3 benchmarks/bench_gemm.py --out "$OUT" "${BENCH_ARGS[@]}" 2>&1 | tee "$OUT/bench.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
echo "gpu_check: status=$status"
exit $status
