"""`vllm bench throughput` side by side on one GPU: bf16, vLLM FP8 W8A8 (`--quantization fp8`),
kbit with 16-bit activations and kbit with FP8 activations, on a dummy-weight model of a real
shape (e2e.py's shapes), 1000 prompts 512 -> 256 tokens by default. Each config runs vLLM's own
CLI in its own process; its --output-json and the KV cache size it logs are collected into one
JSON stamped with GPU, date, commit and command.

    python3 benchmarks/throughput.py --workdir /tmp/tp --shape 8b --configs bf16,fp8,kbit4,kbit4-fp8
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import git_commit  # noqa: E402
from e2e import SHAPES, write_model_dir  # noqa: E402


def kbit(bits: int, activations: str = "auto") -> list[str]:
    cfg = {"quant_method": "kbit", "bits": bits, "activations": activations}
    return ["--quantization", "kbit", "--hf-overrides", json.dumps({"quantization_config": cfg})]


CONFIGS = {"bf16": [], "fp8": ["--quantization", "fp8"],
           **{f"kbit{b}": kbit(b) for b in (2, 3, 4, 5)},
           **{f"kbit{b}-fp8": kbit(b, "fp8") for b in (2, 3, 4, 5)}}
KV_LINE = re.compile(r"GPU KV cache size: ([\d,]+) tokens")


def run(model: Path, name: str, args, out_dir: Path) -> dict:
    out_json = out_dir / f"throughput_{name}.json"
    cmd = ["vllm", "bench", "throughput", "--model", str(model), "--load-format", "dummy",
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len),
           "--output-json", str(out_json), *CONFIGS[name]]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    log = proc.stdout + proc.stderr
    (out_dir / f"throughput_{name}.log").write_text(log)
    row = {"config": name, "returncode": proc.returncode, "wall_s": round(time.time() - t0, 1),
           "command": " ".join(cmd)}
    kv = KV_LINE.findall(log)
    if kv:
        row["kv_cache_tokens"] = int(kv[-1].replace(",", ""))
    if proc.returncode == 0 and out_json.exists():
        res = json.loads(out_json.read_text())
        row.update({k: res[k] for k in ("requests_per_second", "tokens_per_second", "elapsed_time") if k in res})
    else:
        row["error_tail"] = log[-2000:]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kbit-throughput"))
    ap.add_argument("--shape", choices=list(SHAPES), default="8b")
    ap.add_argument("--configs", default="bf16,fp8,kbit4,kbit4-fp8")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args()
    for c in args.configs.split(","):
        if c not in CONFIGS:
            raise SystemExit(f"throughput.py: unknown config {c!r} (one of {', '.join(CONFIGS)})")
    model = write_model_dir(args.workdir / args.shape, SHAPES[args.shape])
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.configs.split(","):
        rows.append(run(model, name, args, args.out))
        print(json.dumps(rows[-1] if rows[-1]["returncode"] == 0 else {**rows[-1], "error_tail": "..."}), flush=True)
    import torch
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    meta = {"gpu": gpu, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git_commit(), "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "shape": args.shape}
    path = args.out / f"throughput_{args.shape}_{gpu.replace(' ', '_')}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    base = {r["config"]: r.get("requests_per_second") for r in rows}
    for r in rows:
        rel = "  ".join(f"{r.get('requests_per_second', 0) / base[b]:.2f}x {b}" for b in ("bf16", "fp8")
                        if base.get(b) and r.get("requests_per_second"))
        print(f"{r['config']:10s} {r.get('requests_per_second', float('nan')):7.2f} req/s  "
              f"KV {r.get('kv_cache_tokens', '?')}  {rel}")
    print(f"# wrote {path}")


if __name__ == "__main__":
    main()
