"""Offline generation from a kbit checkpoint with vllm.LLM (the plugin is found through its entry point).

    python3 examples/offline_generate.py MODEL_DIR [--max-tokens 32]
"""
import argparse
import sys

from vllm_kbit.check import gpu_problem


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    problem = gpu_problem()  # before vLLM, whose own error on a CPU machine does not say this
    if problem:
        print(f"error: offline_generate.py needs a CUDA GPU with the kbit kernels: {problem}", file=sys.stderr)
        return 1
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, max_model_len=1024, gpu_memory_utilization=0.5)
    print("quantization:", llm.llm_engine.vllm_config.model_config.quantization)
    prompts = ["The quick brown fox", "Quantization stores each weight", "Once upon a time"]
    for o in llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0)):
        print(f"{o.prompt!r} -> {o.outputs[0].text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
