"""Run one vLLM engine with the features a compatibility test turns on, and dump its outputs.

    python3 tests/compat_runner.py SPEC_JSON OUT_JSON

SPEC_JSON: {"model": DIR, "engine": {vllm.LLM keyword arguments}, "adapters": {NAME: DIR},
"jobs": [JOB, ...]}. Each JOB has a "name" and a "kind":
- "generate":  greedy continuations of "prompts" (text, or {"prompt_token_ids": [...]}), each
  step's top-`logprobs` tokens, and the prefix-cache hits; "passes" times (a later pass finds
  the earlier one's blocks in the prefix cache where it is on);
- "prompt_logprobs": teacher-forced logprobs of the prompts (e2e_common.compare's format);
- "chat": greedy answers to "messages" (lists of {"role", "content"}) through the chat template;
- "structured": one greedy answer per entry of "cases" (StructuredOutputsParams keyword arguments).
generate and prompt_logprobs take "loras": one adapter name (or null) per prompt, all in one batch.
"metrics": true adds the engine's speculative-decoding counters.
One process per engine: vLLM keeps global state that a second engine in the same process trips on.
"""
import json
import sys


def _steps(logprobs) -> list[dict]:
    return [{str(t): lp.logprob for t, lp in step.items()} for step in (logprobs or [])]


def _completion(o, c) -> dict:
    return {"prompt_ids": list(o.prompt_token_ids), "ids": list(c.token_ids), "text": c.text,
            "steps": _steps(c.logprobs), "cached": o.num_cached_tokens or 0}


def main() -> None:
    spec_path, out_path = sys.argv[1:3]
    with open(spec_path) as f:
        spec = json.load(f)

    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=spec["model"], **spec["engine"])
    adapters = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(spec.get("adapters", {}).items())}

    def loras(job):
        names = job.get("loras")
        return None if names is None else [adapters[n] if n else None for n in names]

    result = {"quantization": llm.llm_engine.vllm_config.model_config.quantization, "jobs": {}}
    for job in spec["jobs"]:
        kind, name = job["kind"], job["name"]
        if kind == "generate":
            sp = SamplingParams(max_tokens=job.get("max_tokens", 24), temperature=0.0,
                                logprobs=job.get("logprobs", 2), ignore_eos=True)
            passes = []
            for _ in range(job.get("passes", 1)):
                outs = llm.generate(job["prompts"], sp, lora_request=loras(job), use_tqdm=False)
                passes.append([_completion(o, o.outputs[0]) for o in outs])
            out = {"passes": passes}
        elif kind == "prompt_logprobs":
            sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
            outs = llm.generate(job["prompts"], sp, lora_request=loras(job), use_tqdm=False)
            out = {"prompt_logprobs": [[{str(t): [lp.logprob, lp.rank] for t, lp in pos.items()} if pos else None
                                        for pos in o.prompt_logprobs] for o in outs],
                   "prompt_ids": [list(o.prompt_token_ids) for o in outs]}
        elif kind == "chat":
            sp = SamplingParams(max_tokens=job.get("max_tokens", 16), temperature=0.0,
                                logprobs=job.get("logprobs", 2), ignore_eos=True)
            outs = llm.chat(job["messages"], sp, use_tqdm=False)
            out = {"passes": [[_completion(o, o.outputs[0]) for o in outs]]}
        elif kind == "structured":
            out = {"texts": []}
            for case in job["cases"]:
                sp = SamplingParams(max_tokens=job.get("max_tokens", 64), temperature=0.0,
                                    structured_outputs=StructuredOutputsParams(**case))
                o = llm.generate([job["prompt"]], sp, use_tqdm=False)[0]
                out["texts"].append({"text": o.outputs[0].text, "finish_reason": o.outputs[0].finish_reason})
        else:
            raise ValueError(f"compat_runner: job {name!r} has unknown kind {kind!r}")
        result["jobs"][name] = out
    if spec.get("metrics"):
        from vllm.v1.metrics.reader import Counter
        result["metrics"] = {}
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode") and isinstance(m, Counter):
                result["metrics"][m.name] = result["metrics"].get(m.name, 0) + m.value
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
