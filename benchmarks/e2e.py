"""End-to-end vLLM speed on a Llama-3-8B-shaped model (--shape: 70b, or the MoE shapes
qwen3-30b-a3b and mixtral-8x7b): bf16, GPTQ 4-bit (vLLM picks Marlin or Machete; Llama shapes
only), and kbit K = 2..5, each in its own engine process, same method for all:

  latency     one batch of bs = 1 and bs = 16, 128 prompt tokens -> 256 generated (ignore_eos),
              as `vllm bench latency` does (random token ids, median of --iters after a warm-up);
  throughput  --num-prompts prompts of 512 -> 256 tokens, submitted at once (`vllm bench throughput`),
              with at most --max-num-seqs running (default 256);
              0 leaves vLLM's default (1024 on an H100 / H200, what `vllm bench throughput` runs).

    python3 benchmarks/e2e.py --workdir /tmp/e2e [--configs bf16,gptq4,kbit4] [--num-prompts 1000] [--tag NAME]
    python3 benchmarks/e2e.py --configs kbit4,kbit4+TORCHINDUCTOR_ENABLE_PDL=1   # A/B: a config + its engine's environment
    python3 benchmarks/e2e.py --configs A,B,A,B                   # alternated: rows A, B, A#2, B#2
    python3 benchmarks/e2e.py --configs kbit4,kbit4_lmhead       # lm_head kbit too ("lm_head": true)
    python3 benchmarks/e2e.py --shape qwen3-30b-a3b --configs bf16,kbit4,kbit2   # MoE: kbit experts

Weights: bf16 and kbit use --load-format dummy (kbit fills random *valid* kbit weights); GPTQ
gets a real checkpoint with valid packed 4-bit weights (round-to-nearest, group 128, written
here), because dummy loading leaves integer tensors uninitialised, and because on a folder
without safetensors vLLM quantizes no layer of a GPTQ config (gptq4_dummy shows it).
Results: JSON + markdown table + PNG in benchmarks/results/ (--out), named e2e_SHAPE.* unless
--tag names them; the JSON and the table are rewritten after every engine, so a timeout keeps
what was measured. Each result keeps vLLM's memory log lines and the GPU's free memory when its
engine started; each engine's process group is gone before the next starts. A kbit row gets an
error instead of figures unless its engine logged that kbit layers run the CUDA kernels.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                 vocab_size=128256)
LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, num_kv_heads=8,
                  vocab_size=128256)
# MoE shapes (--shape): the transformers config class and its own keys; run them with
# --configs bf16,kbit4,kbit2 (gptq4 writes Llama checkpoints)
MOE_SHAPES = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                             num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                             num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                             head_dim=128, vocab_size=151936, rope_theta=1000000.0)),
    # 94 layers of 128 experts: about 97 GB of weights at K=3 (one H200), 68 GB at K=2 (one H100)
    "qwen3-235b-a22b": ("Qwen3MoeConfig", dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                                               num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                               num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                                               head_dim=128, vocab_size=151936, rope_theta=1000000.0)),
    "mixtral-8x7b": ("MixtralConfig", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8,
                                           num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32,
                                           num_key_value_heads=8, vocab_size=32000, rope_theta=1000000.0)),
}
SHAPES = {"8b": LLAMA3_8B, "70b": LLAMA3_70B, **MOE_SHAPES}

# vLLM's log lines about GPU memory and the KV cache, kept with each result
MEMORY_LOG = ("KV cache", "Available KV cache memory", "Model loading took", "memory profiling",
              "GPU KV cache size", "Maximum concurrency")
# what the plugin logs in the engine process (vllm_kbit/linear.py)
KBIT_LOG = "vllm_kbit: kbit layers run "
KBIT_KERNELS = KBIT_LOG + "the CUDA kernels"


def nvml_memory() -> dict:
    """The GPU's free / total memory through NVML, which, unlike torch.cuda, opens no CUDA
    context in this process (one would hold GPU memory through the engine's profile)."""
    try:
        try:
            from vllm.third_party import pynvml
        except ImportError:
            import pynvml
        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
        mem, name = pynvml.nvmlDeviceGetMemoryInfo(handle), pynvml.nvmlDeviceGetName(handle)
        return {"gpu": name.decode() if isinstance(name, bytes) else name,
                "gpu_free_gib": mem.free / 2**30, "gpu_total_gib": mem.total / 2**30}
    except Exception as e:  # no NVML: recorded, not fatal
        return {"nvml_error": f"{type(e).__name__}: {e}"}


def collect_result(config: dict, lines: list[str], returncode: int | None) -> dict:
    """One config's row from its worker's output: its figures, or an error. A kbit row whose
    engine did not log that kbit layers run the CUDA kernels gets an error instead of figures."""
    logs = {"memory_log": [l.strip() for l in lines if any(k in l for k in MEMORY_LOG)],
            "kbit_log": [l.strip() for l in lines if KBIT_LOG in l], "returncode": returncode}
    line = next((l for l in lines if l.startswith("E2E_RESULT ")), None)
    if line is None:
        errors = [l for l in lines if "Error" in l]
        return {"error": (errors or [l for l in lines if l.strip()] or ["no result"])[-1].strip(), **logs}
    result = json.loads(line[len("E2E_RESULT "):])
    if config.get("quantization") == "kbit" or result.get("quantization") == "kbit":
        if not any(KBIT_KERNELS in l for l in logs["kbit_log"]):
            seen = logs["kbit_log"][-1] if logs["kbit_log"] else f"no '{KBIT_LOG}...' line in the engine's log"
            return {"error": f"kbit without its CUDA kernels in the engine, figures withheld: {seen}",
                    "gpu_at_start": result.get("gpu_at_start"), "kbit_extension_here": result.get("kbit_extension_here"),
                    **logs}
    result["kernel_log"] = [l for l in lines if "Using" in l and "Kernel" in l][:2]
    return {**result, **logs}


def process_group_alive(pgid: int) -> bool:
    """Whether a process of the group is still running (zombies hold no GPU memory)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def wait_group_gone(pgid: int, timeout: float = 120.0) -> bool:
    """Wait until the worker's process group (the engine core and its helpers) has exited;
    kill what is left after `timeout`. True when it went by itself."""
    deadline = time.monotonic() + timeout
    while process_group_alive(pgid):
        if time.monotonic() > deadline:
            try:
                os.killpg(pgid, 9)
            except ProcessLookupError:
                pass
            while process_group_alive(pgid):
                time.sleep(0.5)
            return False
        time.sleep(0.5)
    return True


def in_child(fn, *args, **kwargs) -> None:
    """Run fn in a fresh process: its CUDA work leaves no context (nor GPU memory) in this one."""
    import multiprocessing

    p = multiprocessing.get_context("spawn").Process(target=fn, args=args, kwargs=kwargs)
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"{fn.__name__}{args} failed (exit status {p.exitcode})")


def write_model_dir(dst: Path, shape: dict) -> Path:
    """config.json + tokenizer only: enough for --load-format dummy."""
    from transformers import LlamaConfig

    from vllm_kbit.synthetic import make_random_llama
    if (dst / "config.json").exists():
        return dst
    tiny = make_random_llama(dst.parent / (dst.name + "-tok"), hidden_size=64, intermediate_size=128,
                             num_layers=1, num_heads=2, num_kv_heads=1, vocab_size=512)
    dst.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tiny / "config.json").read_text())
    if isinstance(shape, tuple):  # an MoE shape: (config class, its keys)
        import transformers
        getattr(transformers, shape[0])(**shape[1], max_position_embeddings=4096, bos_token_id=cfg["bos_token_id"],
                                        eos_token_id=cfg["eos_token_id"], dtype="bfloat16",
                                        architectures=[shape[0].replace("Config", "ForCausalLM")]).save_pretrained(dst)
        return dst
    LlamaConfig(hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
                num_key_value_heads=shape["num_kv_heads"], vocab_size=shape["vocab_size"],
                max_position_embeddings=4096, bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"],
                rope_theta=500000.0, dtype="bfloat16").save_pretrained(dst)
    return dst


def write_gptq_dir(base: Path, dst: Path, group: int = 128, weights: bool = True) -> Path:
    """A GPTQ (AutoGPTQ v1, sym, 4-bit, g128, no act-order) checkpoint with valid packed weights:
    round-to-nearest of N(0, 0.02) weights, generated layer by layer on the GPU. weights=False
    writes its config.json and tokenizer only: all that --load-format dummy reads."""
    from safetensors.torch import save_file
    if (dst / "config.json").exists():
        return dst
    dst.mkdir(parents=True)
    cfg = json.loads((base / "config.json").read_text())
    if not weights:
        _write_gptq_config(base, dst, cfg, group)
        return dst
    h, inter, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
              "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    g = torch.Generator(device="cuda").manual_seed(0)
    shift = torch.arange(0, 32, 4, device="cuda", dtype=torch.int32)
    index, shard = {}, {}
    for layer in range(L):
        for name, (n, k) in shapes.items():
            w = torch.randn(k, n, device="cuda", generator=g) * 0.02          # GPTQ stores W^T [K, N]
            s = w.reshape(k // group, group, n).abs().amax(1) / 7.5
            q = torch.clamp(torch.round(w / s.repeat_interleave(group, 0)) + 8, 0, 15).to(torch.int32)
            packed = (q.reshape(k // 8, 8, n) << shift.view(1, 8, 1)).sum(1, dtype=torch.int32)
            p = f"model.layers.{layer}.{name}"
            shard[p + ".qweight"] = packed.cpu()
            shard[p + ".scales"] = s.half().cpu()
            shard[p + ".qzeros"] = torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32)  # zero 8, stored -1
            shard[p + ".g_idx"] = torch.arange(k, dtype=torch.int32) // group
        for norm in ("input_layernorm", "post_attention_layernorm"):
            shard[f"model.layers.{layer}.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
        if (layer + 1) % 8 == 0 or layer == L - 1:
            fname = f"model-{layer:05d}.safetensors"
            save_file(shard, dst / fname, metadata={"format": "pt"})
            index.update({t: fname for t in shard})
            shard = {}
    emb = (torch.randn(cfg["vocab_size"], h, device="cuda", generator=g) * 0.02).bfloat16().cpu()
    save_file({"model.embed_tokens.weight": emb, "lm_head.weight": emb.clone(),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}, dst / "model-emb.safetensors",
              metadata={"format": "pt"})
    index.update({t: "model-emb.safetensors" for t in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    _write_gptq_config(base, dst, cfg, group)
    return dst


def _write_gptq_config(base: Path, dst: Path, cfg: dict, group: int) -> None:
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                  "sym": True, "checkpoint_format": "gptq"}
    cfg["dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in base.iterdir():
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            (dst / f.name).write_bytes(f.read_bytes())


def worker(args) -> None:
    """One engine: latency at bs 1 and 16, then throughput. Prints one JSON line."""
    import numpy as np
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=args.model, max_model_len=1024, gpu_memory_utilization=0.9, seed=0,
              enable_prefix_caching=False)
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.quantization:
        kw["quantization"] = args.quantization
    if args.bits:  # a kbit config on a plain model folder, the vLLM way: through hf_overrides
        kw["hf_overrides"] = {"quantization_config": {"quant_method": "kbit", "bits": args.bits,
                                                      "lm_head": args.lm_head}}
    if args.load_format:
        kw["load_format"] = args.load_format
    if args.dtype:
        kw["dtype"] = args.dtype
    from vllm_kbit import ops

    at_start = nvml_memory()  # before this engine: what the previous ones left
    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup = time.perf_counter() - t0
    vc = llm.llm_engine.vllm_config
    rng = np.random.default_rng(0)

    def prompts(n, length):
        return [TokensPrompt(prompt_token_ids=rng.integers(0, 10000, length).tolist()) for _ in range(n)]

    out = {"quantization": vc.model_config.quantization, "startup_s": startup,
           "kv_cache_tokens": (vc.cache_config.num_gpu_blocks or 0) * vc.cache_config.block_size,
           "max_num_seqs": vc.scheduler_config.max_num_seqs,
           "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
           "gpu_mem_used_gib": (torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]) / 2**30,
           "gpu_at_start": at_start, "gpu": torch.cuda.get_device_name(),
           # this process's view; the engine process's is its log line (collect_result)
           "kbit_extension_here": ops.kernels_in_use()}
    print("E2E_PARTIAL " + json.dumps(out), flush=True)  # what is measured so far survives a timeout
    lat_sp = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0.0)
    for bs in (1, 16) if args.iters else ():
        batch = prompts(bs, 128)
        llm.generate(batch, lat_sp, use_tqdm=False)  # warm-up
        times = []
        for _ in range(args.iters):
            t = time.perf_counter()
            llm.generate(batch, lat_sp, use_tqdm=False)
            times.append(time.perf_counter() - t)
        out[f"latency_bs{bs}_s"] = float(np.median(times))
        print("E2E_PARTIAL " + json.dumps(out), flush=True)
    if args.num_prompts:
        batch = prompts(args.num_prompts, 512)
        sp = SamplingParams(max_tokens=256, ignore_eos=True, temperature=1.0)
        t = time.perf_counter()
        llm.generate(batch, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        out["throughput_req_s"] = args.num_prompts / dt
        out["throughput_out_tok_s"] = args.num_prompts * 256 / dt
    print("E2E_RESULT " + json.dumps(out), flush=True)


CONFIGS = {
    "bf16": dict(load_format="dummy"),
    "gptq4": dict(gptq=True),
    # a GPTQ config on a folder without weights, dummy loading: no gain over bf16, because
    # vLLM then quantizes nothing: AutoGPTQConfig takes the quantized modules from
    # the folder's safetensors dtypes when the config does not list modules_in_block_to_quantize,
    # so it gets bf16's KV cache room and speed
    "gptq4_dummy": dict(gptq=True, load_format="dummy"),
    **{f"kbit{b}": dict(load_format="dummy", quantization="kbit", bits=b) for b in (2, 3, 4, 5)},
    # lm_head quantized too (convert --quantize-lm-head)
    **{f"kbit{b}_lmhead": dict(load_format="dummy", quantization="kbit", bits=b, lm_head=True) for b in (2, 4)},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/kbit-e2e"))
    ap.add_argument("--configs", default="bf16,gptq4,kbit2,kbit3,kbit4,kbit5")
    ap.add_argument("--shape", choices=list(SHAPES), default="8b")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--iters", type=int, default=3, help="latency runs per batch size (0: no latency)")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="0: vLLM's default")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--tag", help="stem of the result files (default e2e_SHAPE)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--quantization", help=argparse.SUPPRESS)
    ap.add_argument("--load-format", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--bits", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--lm-head", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    base = write_model_dir(args.workdir / (args.shape if args.shape in MOE_SHAPES else f"llama-{args.shape}"),
                           SHAPES[args.shape])
    results = {}
    for name in args.configs.split(","):
        base_name, *assignments = name.split("+")  # e.g. kbit4+TORCHINDUCTOR_ENABLE_PDL=1: environment of that engine
        if name in results:  # a config named again (A, B, A, B alternation): its own row, "NAME#2"
            name = f"{name}#{sum(k.split('#')[0] == name for k in results) + 1}"
        c = CONFIGS[base_name]
        env = dict(os.environ, **dict(a.split("=", 1) for a in assignments))
        model, extra = base, []
        if c.get("gptq"):
            # dummy loading reads no weights: its folder needs the config (and tokenizer) alone
            dummy = c.get("load_format") == "dummy"
            model = args.workdir / f"llama-{args.shape}-gptq4{'-config' if dummy else ''}"
            if not (model / "config.json").exists():
                in_child(write_gptq_dir, base, model, weights=not dummy)
            extra = ["--dtype", "float16"]
        if c.get("load_format"):
            extra += ["--load-format", c["load_format"]]
        if c.get("quantization"):
            extra += ["--quantization", c["quantization"], "--bits", str(c["bits"])]
            extra += ["--lm-head"] if c.get("lm_head") else []
        cmd = [sys.executable, __file__, "--worker", "--model", str(model), "--iters", str(args.iters),
               "--num-prompts", str(args.num_prompts), "--max-num-seqs", str(args.max_num_seqs), *extra]
        print("$", " ".join(assignments + cmd), flush=True)
        # stdout and stderr together, streamed: E2E_PARTIAL lines show up as they are measured
        # its own process group: the engine core and its helpers are waited for (and their GPU
        # memory freed) before the next config starts
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                             start_new_session=True)
        lines = []
        for l in p.stdout:
            lines.append(l.rstrip("\n"))
            if l.startswith("E2E_PARTIAL "):
                print(f"  {name}: {l[len('E2E_PARTIAL '):].rstrip()}", flush=True)
        p.wait()
        exited = wait_group_gone(p.pid)
        results[name] = collect_result(c, lines, p.returncode)
        if not exited:
            results[name]["stragglers_killed"] = True
        if "error" in results[name]:
            print("\n".join(lines)[-8000:])
            print(name, "error:", results[name]["error"], flush=True)
        else:
            print(name, {k: v for k, v in results[name].items() if k not in ("memory_log", "kbit_log")}, flush=True)
        report(args, results, final=False)  # what is measured so far survives a timeout of the rest
    report(args, results)


def report(args, results, final: bool = True) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    # the GPU's name from a result or NVML: torch.cuda here would hold a CUDA context (and GPU
    # memory) in this process through every later engine
    gpu = next((r["gpu"] for r in results.values() if "gpu" in r), None) or nvml_memory().get("gpu", "unknown GPU")
    stamp = {"gpu": gpu, "date": datetime.date.today().isoformat(),
             # the device machine gets the tree without .git: the caller passes the commit
             "commit": os.environ.get("KBIT_GIT_COMMIT") or subprocess.run(
                 ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip(),
             "command": " ".join(sys.argv), "shape": args.shape}
    tag = args.tag or f"e2e_{args.shape}"
    (args.out / f"{tag}.json").write_text(json.dumps({**stamp, "results": results}, indent=2))
    rows = ["| config | bs=1 latency (s) | bs=16 latency (s) | throughput (req/s) | KV tokens | GPU mem (GiB) |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {name} | error: {r['error'][:80]} | | | | |")
            continue
        rows.append(f"| {name} | {r.get('latency_bs1_s', float('nan')):.3f} | {r.get('latency_bs16_s', float('nan')):.3f} | "
                    f"{r.get('throughput_req_s', float('nan')):.1f} | {r['kv_cache_tokens']} | {r['gpu_mem_used_gib']:.1f} |")
    md = f"{stamp['gpu']}, {stamp['date']}, commit {stamp['commit']}\n\n`{stamp['command']}`\n\n" + "\n".join(rows) + "\n"
    (args.out / f"{tag}.md").write_text(md)
    if not final:
        return
    print(md)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        ok = {k: v for k, v in results.items() if "error" not in v}
        fig, ax = plt.subplots(1, 3, figsize=(12, 3.5))
        for a, key, title in zip(ax, ("latency_bs1_s", "latency_bs16_s", "throughput_req_s"),
                                 ("bs=1 latency (s)", "bs=16 latency (s)", "throughput (req/s)")):
            a.bar(list(ok), [v.get(key, 0) for v in ok.values()])
            a.set_title(title)
            a.tick_params(axis="x", rotation=45)
        fig.suptitle(f"vLLM e2e, {args.shape} shape, {stamp['gpu']}")
        fig.tight_layout()
        fig.savefig(args.out / f"{tag}.png", dpi=80)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
