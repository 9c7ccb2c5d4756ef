"""Quickstart: a small random-init model (Llama by default) -> kbit -> check -> generate with vLLM.

    python3 examples/quickstart.py [--bits 4] [--workdir out/quickstart] [--arch qwen2]

--arch picks another architecture of vllm_kbit.synthetic.ARCHITECTURES (Mistral, Qwen2, Qwen3,
Gemma 2, Phi-3, and the MoE models Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, whose experts are
kbit too; MoE models need vLLM's MoE op library to generate).

Nothing is downloaded: the model is random (so its text is gibberish) and its tokenizer is
trained on the spot. Without a CUDA GPU it stops after the conversion and check.
"""
import argparse
import json
from pathlib import Path

import torch
from safetensors import safe_open

from vllm_kbit import format as kf
from vllm_kbit.check import gpu_problem
from vllm_kbit.convert import convert
from vllm_kbit.synthetic import ARCHITECTURES, make_random_model


def check(src: Path, dst: Path, bits: int) -> None:
    """Every quantized layer dequantizes to within the format's error of the source."""
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "kbit" and qc["bits"] == bits
    src_index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    dst_index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    worst = float("inf")
    for name in (n for n in dst_index if n.endswith(".qweight")):
        prefix = name[: -len(".qweight")]
        with safe_open(dst / dst_index[name], "pt") as f:
            q = f.get_tensor(name)
        with safe_open(dst / dst_index[prefix + ".absmax"], "pt") as f:
            a = f.get_tensor(prefix + ".absmax")
        with safe_open(src / src_index[prefix + ".weight"], "pt") as f:
            w = f.get_tensor(prefix + ".weight")
        worst = min(worst, kf.sqnr_db(w, kf.dequantize(q, a, bits, torch.tensor(qc["codebook"]))))
    print(f"check: every quantized layer dequantizes with SQNR >= {worst:.1f} dB")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=int, default=4, choices=kf.SUPPORTED_BITS)
    ap.add_argument("--workdir", type=Path, default=Path("out/quickstart"))
    ap.add_argument("--arch", default="llama", choices=sorted(ARCHITECTURES))
    args = ap.parse_args()

    src = make_random_model(args.workdir / f"{args.arch}-random", arch=args.arch, hidden_size=512,
                            intermediate_size=1024, num_layers=4, num_heads=8, num_kv_heads=4, vocab_size=1024,
                            max_shard_size="4MB")
    dst = args.workdir / f"{args.arch}-kbit{args.bits}"
    print(convert(src, dst, args.bits, overwrite=True).summary())
    check(src, dst, args.bits)

    problem = gpu_problem()
    if problem:
        print(f"Stopping after the conversion: {problem}. vLLM serves kbit models on NVIDIA GPUs "
              f"(sm_80+) with the kbit kernels: `vllm serve {dst}`.")
        return 0 if not torch.cuda.is_available() else 1
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(dst), max_model_len=512, gpu_memory_utilization=0.3)
    out = llm.generate(["The quick brown fox", "Once upon a time"],
                       SamplingParams(max_tokens=24, temperature=0.0))
    for o in out:
        print(f"{o.prompt!r} -> {o.outputs[0].text!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
