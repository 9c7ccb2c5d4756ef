"""Probe (twenty-fourth session, H200, tree 4eb4c51; benchmarks/profile_step.py is the maintained
profiler, this adds the prefill-only time). Where a vLLM latency run's GPU time goes: prefill-only / 2-token / 256-token batch times and
a per-kernel table of one profiled 256-token run (in-process engine).
  python3 docs/probes/profile_prefill_decode_4eb4c51.py CONFIG MODEL_DIR BS   (MODEL_DIR: e2e.py write_model_dir)     CONFIG: bf16 | kbit4 | kbit4_lmhead"""
import os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import numpy as np, torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

cfg, model, bs = sys.argv[1], sys.argv[2], int(sys.argv[3])
kw = dict(model=model, max_model_len=1024, gpu_memory_utilization=0.9, seed=0, enable_prefix_caching=False,
          max_num_seqs=256, load_format="dummy")
if cfg.startswith("kbit"):
    kw.update(quantization="kbit", hf_overrides={"quantization_config": {
        "quant_method": "kbit", "bits": int(cfg[4]), "lm_head": "lmhead" in cfg}})
llm = LLM(**kw)
rng = np.random.default_rng(0)
batch = [TokensPrompt(prompt_token_ids=rng.integers(0, 10000, 128).tolist()) for _ in range(bs)]
res = {}
for n in (1, 2, 256):
    sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
    llm.generate(batch, sp, use_tqdm=False)
    ts = []
    for _ in range(5 if n < 256 else 3):
        torch.cuda.synchronize(); t = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        ts.append(time.perf_counter() - t)
    res[n] = float(np.median(ts))
print(f"PROF {cfg} bs={bs} gen1 {res[1]*1e3:.2f} ms gen2 {res[2]*1e3:.2f} ms gen256 {res[256]*1e3:.1f} ms "
      f"-> per decode step {(res[256]-res[1])/255*1e3:.3f} ms")
sp = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0.0)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    llm.generate(batch, sp, use_tqdm=False)
rows = []
for e in prof.key_averages():
    t = getattr(e, "self_device_time_total", None)
    if t is None:
        t = e.self_cuda_time_total
    if t > 0:
        rows.append((t, e.count, e.key))
rows.sort(reverse=True)
tot = sum(r[0] for r in rows)
print(f"PROF {cfg} bs={bs} kernel total {tot/1e3:.1f} ms over {sum(r[1] for r in rows)} kernels")
for t, c, k in rows[:22]:
    print(f"PROF {cfg} {t/1e3:9.2f} ms {c:7d}  {t/c:8.2f} us  {k[:110]}")
