"""Serve a kbit checkpoint with `vllm serve DIR` (no flags: the method is read from config.json)
and query it through the OpenAI-compatible API.

    python3 examples/serve_and_query.py MODEL_DIR [--port 8011]
"""
import argparse
import json
import subprocess
import sys
import time
import urllib.request

from vllm_kbit.check import gpu_problem


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--port", type=int, default=8011)
    args = ap.parse_args()
    problem = gpu_problem()  # before starting a server that would fail with a less direct error
    if problem:
        print(f"error: serve_and_query.py needs a CUDA GPU with the kbit kernels: {problem}", file=sys.stderr)
        return 1
    base = f"http://127.0.0.1:{args.port}"
    cmd = ["vllm", "serve", args.model, "--port", str(args.port), "--max-model-len", "1024",
           "--gpu-memory-utilization", "0.5"]
    print("$", " ".join(cmd), flush=True)
    server = subprocess.Popen(cmd)
    try:
        for _ in range(600):
            if server.poll() is not None:
                print("server exited with", server.returncode)
                return 1
            try:
                urllib.request.urlopen(base + "/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        else:
            print("server did not come up in 600 s")
            return 1
        model = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
        r = post(base + "/v1/completions", {"model": model, "prompt": "The quick brown fox",
                                            "max_tokens": 24, "temperature": 0})
        print("completion:", repr(r["choices"][0]["text"]), "| usage:", r["usage"])
        r = post(base + "/v1/chat/completions", {"model": model, "max_tokens": 24, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "Hello!"}]})
        print("chat:", repr(r["choices"][0]["message"]["content"]))
        return 0
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
