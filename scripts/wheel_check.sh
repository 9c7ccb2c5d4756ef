#!/usr/bin/env bash
# On a GPU machine with a CUDA torch and the CUDA toolkit: build the wheel (scripts/build_wheel.sh),
# install it into a fresh virtual environment that sees this environment's torch, and check it
# where no CUDA toolkit can be found (nvcc off PATH, CUDA_HOME unset, /usr/local/cuda* moved
# aside when run as root, restored on exit): `python3 -m vllm_kbit.check` from outside the
# repository, and, with .vllm-bundle/activate.sh present, `vllm serve` of a random kbit model and
# one completion through its OpenAI API. Logs go to $OUT (./out when run by hand).
#   scripts/wheel_check.sh                 (MAX_JOBS, TORCH_CUDA_ARCH_LIST as for build_wheel.sh)
#   WHEEL=dist/vllm_kbit-....whl scripts/wheel_check.sh   (a wheel built before: no build step)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { echo; echo "=== $* ($(date +%T))"; }
fail() { echo "wheel_check: FAILED: $*"; exit 1; }
WORK="$(mktemp -d /tmp/kbit-wheel-XXXX)"
HIDDEN=()
restore() {
    for d in "${HIDDEN[@]}"; do mv "$d.kbit-hidden" "$d"; done
    [ -n "${SERVER:-}" ] && kill "$SERVER" 2>/dev/null
    rm -rf "$WORK"
}
trap restore EXIT
trap 'exit 143' TERM INT
for d in /usr/local/cuda*.kbit-hidden; do  # a run killed before it could restore them
    [ -e "$d" ] && mv "$d" "${d%.kbit-hidden}" && echo "restored ${d%.kbit-hidden}"
done

if [ -n "${WHEEL:-}" ]; then  # built earlier (scripts/build_wheel.sh in a call of its own)
    WHEEL="$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")"
    [ -f "$WHEEL" ] || fail "WHEEL=$WHEEL does not exist"
else
    step "build"
    t0=$(date +%s)
    MAX_JOBS="${MAX_JOBS:-16}" bash scripts/build_wheel.sh "$WORK/dist" >"$OUT/wheel_build.log" 2>&1 \
        || { grep -E "error|Error" "$OUT/wheel_build.log" | head -30; tail -20 "$OUT/wheel_build.log"; fail "build"; }
    tail -1 "$OUT/wheel_build.log"
    echo "build time: $(( $(date +%s) - t0 )) s"
    WHEEL="$(ls "$WORK"/dist/vllm_kbit-*.whl)"
fi
ls -l "$WHEEL"
CUOBJDUMP="$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)"
( cd "$WORK" && python3 -m zipfile -e "$WHEEL" unpacked >/dev/null && \
  "$CUOBJDUMP" --list-elf unpacked/vllm_kbit/_C*.so | grep -o "sm_[0-9a-z]*" | sort | uniq -c ) \
  || echo "(cuobjdump could not list the wheel's architectures)"

step "install into a fresh venv (torch from this environment, nothing else)"
python3 -m venv --without-pip "$WORK/venv" || fail "venv"
VPY="$WORK/venv/bin/python3"
VSITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# This environment's site folders (torch's among them) after the venv's own: --system-site-packages
# would give the base interpreter's, not those of the (virtual) environment python3 runs in.
python3 -c "import sys; print('import site; ' + '; '.join(f'site.addsitedir({p!r})' for p in sys.path if p.endswith('-packages')))" \
    > "$VSITE/kbit-host-env.pth"
python3 -m pip install -q --no-deps --no-index --target "$VSITE" "$WHEEL" || fail "pip install of the wheel"
if [ -f .vllm-bundle/activate.sh ]; then  # vLLM 0.24 for the check's plugin line and for serving
    # shellcheck disable=SC1091
    source .vllm-bundle/activate.sh >/dev/null
fi

step "hide the CUDA toolkit"
unset CUDA_HOME CUDA_PATH CUDA_ROOT CUDA_INC_PATH
PATH="$(echo "$PATH" | tr ':' '\n' | grep -v cuda | while read -r d; do [ -x "$d/nvcc" ] || echo "$d"; done | paste -sd:)"
export PATH
if [ "$(id -u)" -eq 0 ]; then
    for d in /usr/local/cuda /usr/local/cuda-*; do
        [ -e "$d" ] || [ -L "$d" ] || continue
        mv "$d" "$d.kbit-hidden" && HIDDEN+=("$d")
    done
fi
command -v nvcc && fail "nvcc is still on PATH"
ls /usr/local/cuda*/include/cuda_runtime_api.h 2>/dev/null && echo "(CUDA headers still visible: not root)"
echo "moved aside: ${HIDDEN[*]:-nothing}; nvcc: none on PATH; CUDA_HOME unset"

step "python3 -m vllm_kbit.check (outside the repository)"
mkdir -p "$WORK/elsewhere"
cd "$WORK/elsewhere"
"$VPY" -m vllm_kbit.check 2>&1 | tee "$OUT/wheel_vllm_kbit_check.log"
rc=${PIPESTATUS[0]}
grep -q "vllm_kbit 0.1.0 at $WORK/venv/" "$OUT/wheel_vllm_kbit_check.log" || fail "the check did not run the wheel's package"
[ "$rc" -eq 0 ] || fail "python3 -m vllm_kbit.check exit status $rc"
[ -f "$REPO/.vllm-bundle/activate.sh" ] || { echo "wheel_check: OK (no .vllm-bundle: vllm serve not run)"; exit 0; }

step "vllm serve a random kbit model"
"$VPY" -c "from vllm_kbit.synthetic import make_random_model as m; m('$WORK/src', hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8, num_kv_heads=4, vocab_size=1024)" \
    >"$OUT/wheel_make_model.log" 2>&1 || { tail "$OUT/wheel_make_model.log"; fail "random model"; }
"$VPY" -m vllm_kbit.convert "$WORK/src" "$WORK/kbit" --bits 4 2>&1 | tail -3
"$VPY" -m vllm.entrypoints.cli.main serve "$WORK/kbit" --port 8017 --max-model-len 512 \
    --gpu-memory-utilization 0.3 --enforce-eager >"$OUT/wheel_vllm_serve.log" 2>&1 &
SERVER=$!
"$VPY" - "$WORK/kbit" "$SERVER" <<'PY' || { tail -30 "$OUT/wheel_vllm_serve.log"; fail "vllm serve"; }
import json, os, sys, time, urllib.request
model, pid, base, t0 = sys.argv[1], int(sys.argv[2]), "http://127.0.0.1:8017", time.time()
while True:
    try:
        urllib.request.urlopen(f"{base}/v1/models", timeout=5)
        break
    except OSError:
        os.kill(pid, 0)  # the server died: ProcessLookupError
        if time.time() - t0 > 240:
            sys.exit("vllm serve not up in 240 s")
        time.sleep(2)
print(f"vllm serve up in {time.time() - t0:.0f} s")
body = json.dumps({"model": model, "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0}).encode()
req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
r = json.load(urllib.request.urlopen(req, timeout=60))
print("completion:", repr(r["choices"][0]["text"]), r["usage"])
assert r["usage"]["completion_tokens"] == 16
PY
grep -i -m3 "kbit" "$OUT/wheel_vllm_serve.log"
kill "$SERVER"; wait "$SERVER" 2>/dev/null; SERVER=
echo "wheel_check: OK"
