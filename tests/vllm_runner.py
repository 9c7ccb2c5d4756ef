"""Run one vLLM engine in its own process and dump what the end-to-end tests compare.

    python3 tests/vllm_runner.py MODEL OUT_JSON [--eager] [--tp N] [--quantization Q] [--load-format F]

Writes {"quantization": ..., "prompt_logprobs": [[{token: [logprob, rank]} per position] per prompt],
"greedy": [[token ids] per prompt]}. One process per engine: vLLM keeps global state
(distributed groups, compiled graphs) that a second engine in the same process would trip on.
"""
import argparse
import json

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins",
    "Language models predict the next token from the tokens that came before it, and",
    "Once upon a time, in a small village by the sea, there lived an old fisherman",
    "def main():\n    for i in range(10):\n        print(i)\n    return",
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3,
              enforce_eager=args.eager, tensor_parallel_size=args.tp, seed=0,
              quantization=args.quantization, load_format=args.load_format)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, prompt_logprobs=1)
    outs = llm.generate(PROMPTS, sp)
    result = {
        "quantization": llm.llm_engine.vllm_config.model_config.quantization,
        # per position (the first has none): {token id: [logprob, rank]} of the actual token and the top-1
        "prompt_logprobs": [[{str(t): [lp.logprob, lp.rank] for t, lp in pos.items()} if pos else None
                             for pos in o.prompt_logprobs] for o in outs],
        "prompt_ids": [list(o.prompt_token_ids) for o in outs],
        "greedy": [list(o.outputs[0].token_ids) for o in outs],
    }
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
