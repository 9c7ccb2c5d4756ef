"""Probe: how much of the dequantize pass hides behind cuBLAS when the two run on two streams.
The linear layers of an 8B decode step (32 layers x qkv, o, gate_up, down) at large M, K=4, eager:
  seq      dequantize layer i, then x @ W_i^T, one stream (the op's dequantize path, one chunk)
  overlap  dequantize layer i + 1 on a side stream while the GEMM of layer i runs (an upper
           bound of what chunk pipelining inside one op call could reach)
  mm       cuBLAS alone on dequantized weights (the floor)
Each is timed twice (seq / seq2, overlap / overlap2), µs per step, median of 6.
usage: python3 scripts/overlap_probe.py [M ...]
"""
import statistics
import sys

import torch

from vllm_kbit import format as kf
from vllm_kbit import ops  # noqa: F401  (registers torch.ops.kbit)

SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
LAYERS, BITS = 32, 4


def timed(fn, reps=7):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts[1:])


def main():
    ms = [int(v) for v in sys.argv[1:]] or [512, 1000]
    cb = kf.normal_float_codebook(BITS, "cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            q = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 32 * BITS), generator=g, device="cuda", dtype=torch.int32)
            a = torch.randint(0x28, 0x90, (n, k // 32), generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)
            p, ap = torch.ops.kbit.repack(q, a, BITS)
            layers.append((p, ap, n, k))

    def dq(i):
        p, ap, n, k = layers[i]
        return torch.ops.kbit.dequantize_tiled(p, ap, cb, BITS, n, k, torch.float16)

    s2 = torch.cuda.Stream()
    for m in ms:
        xs = {k: torch.randn(m, k, device="cuda", dtype=torch.float16) for k in (4096, 14336)}

        def seq():
            for i, (_, _, n, k) in enumerate(layers):
                torch.mm(xs[k], dq(i).t())

        def overlap():
            main = torch.cuda.current_stream()
            s2.wait_stream(main)
            with torch.cuda.stream(s2):
                w_next = dq(0)
            for i, (_, _, n, k) in enumerate(layers):
                ev = torch.cuda.Event()
                ev.record(s2)
                main.wait_event(ev)
                w = w_next
                w.record_stream(main)
                if i + 1 < len(layers):
                    with torch.cuda.stream(s2):
                        w_next = dq(i + 1)
                torch.mm(xs[k], w.t())
            main.wait_stream(s2)

        ws = [dq(i) for i in range(4)]  # one layer's four weights, reused (the floor needs no 14 GB)

        def mm():
            for i, (_, _, n, k) in enumerate(layers):
                torch.mm(xs[k], ws[i % 4].t())

        t = {name: timed(f) for name, f in (("seq", seq), ("overlap", overlap), ("mm", mm), ("seq2", seq),
                                            ("overlap2", overlap))}
        print(f"M={m}: " + "  ".join(f"{k} {v:.0f}" for k, v in t.items()), flush=True)


if __name__ == "__main__":
    main()
