"""`vllm bench serve` against `vllm serve` for bf16 and kbit on a Llama-3-8B-shaped model:
1000 requests (512 -> 256 tokens, random dataset) at high concurrency; reports failed requests
and TTFT / TPOT beside bf16. Dummy weights (kbit: random valid kbit weights).

    python3 benchmarks/serve_bench.py --workdir /tmp/e2e [--configs bf16,kbit4] [--concurrency 256]

Figures, with the GPU, commit and command that gave them: docs/PERFORMANCE.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import LLAMA3_8B, write_model_dir  # noqa: E402

HERE = Path(__file__).resolve().parent
CONFIGS = {"bf16": [], **{f"kbit{b}": ["--quantization", "kbit", "--hf-overrides",
                                        json.dumps({"quantization_config": {"quant_method": "kbit", "bits": b}})]
                          for b in (2, 3, 4, 5)}}


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {server.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return
        except OSError:
            time.sleep(2)
    raise TimeoutError("vllm serve did not become healthy")


def gpu_mem_used_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else 0


def stop(server: subprocess.Popen, timeout: float = 90) -> None:
    """SIGTERM the server's process group (API server + engine core), SIGKILL what is left, and
    wait until the GPU memory is given back, so that the next server finds the card empty."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 30)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        try:
            server.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    t0 = time.time()
    while gpu_mem_used_mib() > 2048 and time.time() - t0 < 60:
        time.sleep(1)


def run_one(name: str, model: Path, args) -> dict:
    port = 8000 + list(CONFIGS).index(name)
    serve = ["vllm", "serve", str(model), "--port", str(port), "--load-format", "dummy", "--max-model-len", "1024",
             "--max-num-seqs", str(args.concurrency), *CONFIGS[name]]
    print("$", " ".join(serve), flush=True)
    log_path = args.workdir / f"serve_{name}.log"
    log = open(log_path, "w")
    t0 = time.time()
    # its own process group: stop() reaches the engine core process too
    server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", server)
        except Exception:
            log.flush()
            print(log_path.read_text()[-6000:], flush=True)
            raise
        startup = time.time() - t0
        print(f"{name}: server up in {startup:.0f} s", flush=True)
        result_dir = args.workdir / f"bench_{name}"
        bench = ["vllm", "bench", "serve", "--backend", "vllm", "--model", str(model), "--port", str(port),
                 "--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "256",
                 "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
                 "--ignore-eos", "--save-result", "--result-dir", str(result_dir), "--result-filename", "r.json"]
        print("$", " ".join(bench), flush=True)
        subprocess.run(bench, check=True)
        r = json.loads((result_dir / "r.json").read_text())
        keys = ("completed", "failed", "duration", "request_throughput", "output_throughput",
                *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl") for stat in ("mean", "median", "p99")))
        errors = sorted({e for e in r.get("errors", []) if e})
        return {"server_startup_s": startup, **{k: r.get(k) for k in keys}, "errors": errors[:5]}
    finally:
        stop(server)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kbit-e2e"))
    ap.add_argument("--configs", default="bf16,kbit4")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--tag", default="serve_8b", help="stem of the result file")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = write_model_dir(args.workdir / "llama-8b", LLAMA3_8B)
    results = {name: run_one(name, model, args) for name in args.configs.split(",")}
    stamp = {"gpu": subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                   text=True).stdout.strip().splitlines()[0],
             "date": datetime.date.today().isoformat(), "commit": os.environ.get("KBIT_GIT_COMMIT", ""),
             "command": " ".join(sys.argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.json").write_text(json.dumps({**stamp, "results": results}, indent=2))
    print("| config | completed | failed | req/s | TTFT ms mean / median / p99 | TPOT ms mean / median / p99 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(f"| {name} | {r['completed']} | {r['failed']} | {r['request_throughput']:.1f} | "
              f"{r['mean_ttft_ms']:.0f} / {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | "
              f"{r['mean_tpot_ms']:.1f} / {r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} |")


if __name__ == "__main__":
    main()
