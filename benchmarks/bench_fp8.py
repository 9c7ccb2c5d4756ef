"""Single-layer benchmark of the FP8-activation kbit GEMM (torch.ops.kbit.gemm_fp8) on Llama-3-8B
shapes against FP8 W8A8 GEMMs (per-token x scale, per-channel w scale): torch._scaled_mm
(cuBLAS) and, where vLLM is importable, vLLM's CUTLASS scaled_mm; plus kbit with fp16/bf16
activations (torch.ops.kbit.gemm) and cuBLAS in the activation dtype.

Rows per (shape, M, method), microseconds (bench_gemm.Timer: L2 flushed before each call, CUDA
events, median):
  kbit-fp8 K=b        the op as a layer calls it (the plan's path): x quantization + GEMM
  ... fused / decode-first   the same with the path forced (plan override fp8.path): the fused
                      kernel, or kbit::decode_fp8 + natural-order x + an FP8 scaled_mm
  kbit-fp8 K=b gemm   the fused GEMM alone on a quantized x (kbit::gemm_fp8_quantized)
  decode_fp8 K=4      the decode-first path's weight decode alone
  K=4 gemm MxN        the same at K=4 with the CTA tile forced (--tiles; tokens x columns)
  fp8-quant           kbit's activation quantizer alone
  scaled_mm           torch._scaled_mm, x and W already e4m3 (the GEMM alone)
  cutlass_scaled_mm   vLLM's, same operands; vllm-fp8-quant: vLLM's per-token quantizer;
  vllm-w8a8           vLLM's FP8 layer: its per-token quantizer + cutlass_scaled_mm
  kbit-fp16act K=4    torch.ops.kbit.gemm
  cublas              x @ W^T in the activation dtype
The output is bf16 by default: torch._scaled_mm's row-wise scaling supports only bf16 output.
Writes a JSON stamped with GPU, date, commit and command into --out and prints a table.

  python benchmarks/bench_fp8.py                       # 4 Llama-3-8B shapes x M = 64, 256, 1024, 4096
  python benchmarks/bench_fp8.py --ms 256 --shapes 4096x4096
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

from bench_gemm import Timer, git_commit

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}  # N x K
MS = [64, 256, 1024, 4096]


def log(*a):
    print(*a, flush=True)


def kbit_weight(n, k, bits):
    from vllm_kbit import format as kf
    from vllm_kbit import fp8
    g = torch.Generator(device="cuda").manual_seed(bits)
    idx = torch.randint(0, 1 << bits, (n, k), generator=g, device="cuda").to(torch.uint8)
    e4m4 = torch.randint(0x70, 0xA0, (n, k // 32), generator=g, device="cuda").to(torch.uint8)
    packed, absmax = torch.ops.kbit.repack(kf.pack_bitplanes(idx, bits), e4m4, bits)
    return packed, absmax, kf.normal_float_codebook(bits, "cuda"), fp8.weight_exponent(e4m4)


def vllm_ops():
    try:
        from vllm import _custom_ops as vops
        return vops if hasattr(vops, "cutlass_scaled_mm") else None
    except Exception as e:  # noqa: BLE001  (no vLLM, or one without CUDA ops)
        log(f"# vLLM's cutlass_scaled_mm unavailable: {type(e).__name__}: {e}")
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--shapes", default=None, help="names (qkv,o,gate_up,down) or NxK")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--tiles", default="64x128,128x128,256x128,128x256",
                    help="CTA tiles (tokens x columns) timed forced at K=4, GEMM alone; '' for none")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    import vllm_kbit.ops  # noqa: F401  (schemas, the extension)
    dt = getattr(torch, args.dtype)
    ms = [int(v) for v in args.ms.split(",")]
    shapes = {}
    for s in (args.shapes.split(",") if args.shapes else SHAPES):
        shapes[s] = SHAPES[s] if s in SHAPES else tuple(int(v) for v in s.split("x"))
    bits_list = [int(b) for b in args.bits.split(",")]
    timer = Timer()
    vops = vllm_ops()
    rows = []
    for name, (n, k) in shapes.items():
        weights = {b: kbit_weight(n, k, b) for b in sorted(set(bits_list) | {4})}
        w = (torch.randn(n, k, device="cuda") * 0.02).to(dt)
        w8 = w.float().div(w.float().abs().amax(1, keepdim=True) / 448).to(torch.float8_e4m3fn)
        sw = (w.float().abs().amax(1) / 448).reshape(1, n).contiguous()
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(dt)
            x8 = x.float().div(x.float().abs().amax(1, keepdim=True) / 448).to(torch.float8_e4m3fn)
            sx = (x.float().abs().amax(1) / 448).reshape(m, 1).contiguous()
            t = {}
            for b in bits_list:
                packed, absmax, cb, r = weights[b]
                t[f"kbit-fp8 K={b}"] = timer(lambda: torch.ops.kbit.gemm_fp8(x, packed, absmax, cb, b, n, k, r))
                for label, forced in (("fused", 0), ("decode-first", 1)):
                    t[f"kbit-fp8 K={b} {label}"] = timer(lambda: torch.ops.kbit.gemm_fp8_path(
                        x, packed, absmax, cb, b, n, k, r, None, f"fp8.path={forced}"))
                xq, s = torch.ops.kbit.quantize_act_fp8(x, b)
                t[f"kbit-fp8 K={b} gemm"] = timer(
                    lambda: torch.ops.kbit.gemm_fp8_quantized(xq, s, packed, absmax, cb, b, n, k, r, dt))
            packed, absmax, cb, r = weights[4]
            xq, s = torch.ops.kbit.quantize_act_fp8(x, 4)
            for tile in filter(None, args.tiles.split(",")):
                tm, tn = (int(v) for v in tile.split("x"))
                t[f"K=4 gemm {tile}"] = timer(
                    lambda: torch.ops.kbit.gemm_fp8_quantized(xq, s, packed, absmax, cb, 4, n, k, r, dt, None,
                                                              f"fp8.tile_m={tm},fp8.tile_n={tn}"))
            t["fp8-quant"] = timer(lambda: torch.ops.kbit.quantize_act_fp8(x, 4))
            t["decode_fp8 K=4"] = timer(lambda: torch.ops.kbit.decode_fp8(packed, absmax, cb, 4, n, k, r))
            t["scaled_mm"] = timer(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=dt))
            if vops is not None:
                t["cutlass_scaled_mm"] = timer(lambda: vops.cutlass_scaled_mm(x8, w8.t(), sx, sw.t().contiguous()
                                                                             .reshape(n, 1), dt))
                t["vllm-fp8-quant"] = timer(lambda: vops.scaled_fp8_quant(x, use_per_token_if_dynamic=True))
                swc = sw.t().contiguous().reshape(n, 1)

                def w8a8():
                    xq8, sx8 = vops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
                    return vops.cutlass_scaled_mm(xq8, w8.t(), sx8, swc, dt)
                t["vllm-w8a8"] = timer(w8a8)
            packed, absmax, cb, _ = weights[4]
            t["kbit-fp16act K=4"] = timer(lambda: torch.ops.kbit.gemm(x, packed, absmax, cb, 4, n, k, None))
            t["cublas"] = timer(lambda: x @ w.t())
            base = t["scaled_mm"]
            line = f"{name:8s} {n:6d}x{k:<6d} M={m:5d} " + "  ".join(f"{key} {us:8.1f}" for key, us in t.items())
            log(line)
            for key, us in t.items():
                rows.append({"layer": name, "n": n, "k": k, "m": m, "method": key, "us": round(us, 2),
                             "vs_scaled_mm": round(us / base, 3)})
    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git_commit(), "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "dtype": args.dtype, "torch": torch.__version__}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_fp8_{gpu.replace(' ', '_')}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    log(f"# wrote {path}")
    log("# time / scaled_mm time (kbit-fp8 incl. its x quantization; scaled_mm excl.):")
    for name in shapes:
        for m in ms:
            sel = {r["method"]: r["vs_scaled_mm"] for r in rows if r["layer"] == name and r["m"] == m}
            log(f"{name:8s} M={m:5d} " + "  ".join(f"{key}={v:.2f}" for key, v in sel.items()))


if __name__ == "__main__":
    main()
