# read-only bandwidth ceilings on this GPU: torch reductions over large tensors, and a copy
import torch, statistics
def t(fn, n=30):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    fn(); torch.cuda.synchronize()
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev) * 1e-3
for mb in (62, 512, 2048):
    x = torch.randint(0, 1 << 30, (mb * 2**20 // 4,), device="cuda", dtype=torch.int32)
    h = x.view(torch.float16)
    y = torch.empty_like(x)
    s = t(lambda: h.sum(dtype=torch.float32))
    m = t(lambda: x.max())
    c = t(lambda: y.copy_(x))
    B = x.numel() * 4
    print(f"{mb:5d} MB  sum(fp16->fp32) {B/s/1e9:7.0f} GB/s   max(int32) {B/m/1e9:7.0f} GB/s   copy read {B/c/1e9:7.0f} GB/s (read+write {2*B/c/1e9:7.0f})")
