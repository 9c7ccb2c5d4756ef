"""What vLLM users combine a quantization method with, on kbit models, on a GPU with real vLLM:
prefix caching, chunked prefill, CUDA graphs + torch.compile, an FP8 KV cache, LoRA adapters,
speculative decoding (n-gram and a draft model), the OpenAI server and structured output.

Random models converted to kbit (a dense Llama and a Qwen3-MoE, K = 4 and 2); every row runs
the engine with the feature and compares it with the same model without it (or, for LoRA,
with the bf16 model of the dequantized weights and the same adapters):
- greedy continuations (compat_common.greedy_mismatches): where two runs first differ, the two
  tokens must be a near-tie in the reference; a token outside its top logprobs, or a clear gap,
  fails;
- teacher-forced prompt logprobs (e2e_common.compare): top-1 agreement and mean |dlogprob|.
Each engine runs once, in its own process (tests/compat_runner.py), and serves every row that
needs it; they run one after another. `-k dense`, `-k moe` and `-k server` split the file.
"""
import importlib.util
import json
import math
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm")

from vllm_kbit.convert import convert  # noqa: E402
from vllm_kbit.synthetic import make_random_model  # noqa: E402

from compat_common import (ATTENTION, CHATS, MLP, PROMPTS, RUNNER, RUNNER_ENV, Server, greedy_mismatches,  # noqa: E402
                           run_engine, write_lora_adapter)
from e2e_common import compare, dequantized_copy, logprob_scale  # noqa: E402

# Near-tie bounds of greedy_mismatches: same weights, other batch shapes / kernels (bf16 noise);
# kbit kernels against cuBLAS on the dequantized weights; an FP8 KV cache against a bf16 one.
SAME_WEIGHTS, KBIT_VS_BF16, FP8_KV = 0.15, 0.3, 1.0

BASE = dict(dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.25, seed=0)
# the reference: eager, no prefix caching, every prompt prefilled in one step
EAGER = dict(BASE, enforce_eager=True, enable_prefix_caching=False, max_num_batched_tokens=4096)
# chunked prefill with a 64-token budget: the long prompts (over 100 tokens) take several steps
CHUNKED = dict(enable_chunked_prefill=True, max_num_batched_tokens=64, max_num_seqs=16)
GRAPHS = dict(enforce_eager=False, compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]})
LORA = dict(enable_lora=True, max_loras=2, max_lora_rank=8)

# top-5 logprobs a step: a near-tie of the reference is among them
GEN = {"name": "gen", "kind": "generate", "prompts": PROMPTS, "max_tokens": 24, "logprobs": 5}
GEN2 = dict(GEN, passes=2)
PLP = {"name": "plp", "kind": "prompt_logprobs", "prompts": PROMPTS}
# several adapters in one batch: every prompt with adapter A, adapter B and none
MIXED = [p for p in PROMPTS for _ in range(3)]
MIXED_LORAS = ["A", "B", None] * len(PROMPTS)
CHAT = {"name": "chat", "kind": "chat", "messages": CHATS, "max_tokens": 16, "logprobs": 5}
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "color": {"enum": ["red", "green", "blue"]}},
          "required": ["answer", "color"], "additionalProperties": False}
STRUCTURED = {"name": "structured", "kind": "structured", "prompt": PROMPTS[0], "max_tokens": 64,
              "cases": [{"choice": ["alpha", "beta", "gamma"]}, {"regex": "[0-9]{3}-[a-z]{2}"},
                        {"json": SCHEMA, "disable_any_whitespace": True}]}


# the server: the reference's engine (eager, no prefix caching) with a 32k context
SERVER_ARGS = ["--dtype", "bfloat16", "--max-model-len", "32768", "--gpu-memory-utilization", "0.25",
               "--enforce-eager", "--seed", "0", "--served-model-name", "kbit", "--no-enable-prefix-caching"]


def _ngram_method() -> str:
    # vLLM's CPU n-gram proposer needs numba; its GPU one does not
    return "ngram" if importlib.util.find_spec("numba") else "ngram_gpu"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("compat")
    # init_std 0.08 as in test_e2e_gpu: peaked next-token distributions; positions for 32k
    common = dict(num_heads=8, num_kv_heads=4, vocab_size=512, init_std=0.08, max_position_embeddings=40960)
    llama = make_random_model(root / "llama", arch="llama", hidden_size=512, intermediate_size=1024,
                              num_layers=2, **common)
    moe = make_random_model(root / "moe", arch="qwen3_moe", hidden_size=512, intermediate_size=1024,
                            num_layers=2, **common)
    # the draft: one layer of hidden 256, the same tokenizer and vocabulary
    draft = make_random_model(root / "draft", arch="llama", hidden_size=256, intermediate_size=512, num_layers=1,
                              **dict(common, num_heads=4, num_kv_heads=2))
    m = {}
    for name, src in (("llama", llama), ("moe", moe)):
        for bits in (4, 2):
            convert(src, root / f"{name}{bits}", bits, progress=False)
            m[f"{name}{bits}"] = root / f"{name}{bits}"
        m[f"{name}4dq"] = dequantized_copy(root / f"{name}4", root / f"{name}4dq")
    convert(draft, root / "draft4", 4, progress=False)
    m["draft4"] = root / "draft4"
    m["lora-A"] = write_lora_adapter(root / "lora-A", llama, ATTENTION + MLP, seed=1)
    m["lora-B"] = write_lora_adapter(root / "lora-B", llama, ATTENTION + MLP, seed=2)
    # Qwen3-MoE: the adapters on attention (kbit experts take no LoRA: test_moe_lora_on_experts_...)
    m["moe-lora-A"] = write_lora_adapter(root / "moe-lora-A", moe, ATTENTION, seed=1)
    m["moe-lora-B"] = write_lora_adapter(root / "moe-lora-B", moe, ATTENTION, seed=2)
    m["root"] = root
    return m


def _specs(m):
    """engine key -> (model, LLM keyword arguments, jobs, run_engine keyword arguments)."""
    lora_jobs = [dict(GEN, prompts=MIXED, loras=MIXED_LORAS), dict(PLP, prompts=MIXED, loras=MIXED_LORAS)]
    dense_adapters = {"A": m["lora-A"], "B": m["lora-B"]}
    moe_adapters = {"A": m["moe-lora-A"], "B": m["moe-lora-B"]}
    moe_lora = dict(LORA, lora_target_modules=list(ATTENTION))
    spec = {"num_speculative_tokens": 3}
    s = {
        "llama4-eager": (m["llama4"], EAGER, [GEN, PLP, CHAT, STRUCTURED], {}),
        "llama4-pc-chunked": (m["llama4"], dict(EAGER, enable_prefix_caching=True, **CHUNKED), [GEN2, PLP], {}),
        "llama4-graphs": (m["llama4"], dict(EAGER, **GRAPHS), [GEN, PLP], {}),
        "llama4-fp8kv": (m["llama4"], dict(EAGER, kv_cache_dtype="fp8"), [GEN, PLP], {}),
        "llama4-lora": (m["llama4"], dict(EAGER, **LORA), lora_jobs, {"adapters": dense_adapters}),
        "llama4dq-lora": (m["llama4dq"], dict(EAGER, **LORA), lora_jobs, {"adapters": dense_adapters}),
        "llama4-ngram": (m["llama4"], dict(EAGER, disable_log_stats=False, speculative_config=dict(
            spec, method=_ngram_method(), prompt_lookup_min=2, prompt_lookup_max=4)), [GEN], {"metrics": True}),
        "llama4-draft": (m["llama4"], dict(EAGER, disable_log_stats=False, speculative_config=dict(
            spec, method="draft_model", model=str(m["draft4"]))), [GEN], {"metrics": True}),
        "moe4-eager": (m["moe4"], EAGER, [GEN, PLP], {}),
        "moe4-fp8kv": (m["moe4"], dict(EAGER, kv_cache_dtype="fp8"), [GEN, PLP], {}),
        "moe4-lora": (m["moe4"], dict(EAGER, **moe_lora), lora_jobs, {"adapters": moe_adapters}),
        "moe4dq-lora": (m["moe4dq"], dict(EAGER, **moe_lora), lora_jobs, {"adapters": moe_adapters}),
    }
    # vLLM's defaults: CUDA graphs + torch.compile, prefix caching, chunked prefill (dense K=4
    # has a row for each: test_dense_prefix_caching_..., test_dense_cuda_graphs_...)
    for key in ("llama2", "moe4", "moe2"):
        if key != "moe4":
            s[f"{key}-eager"] = (m[key], EAGER, [GEN, PLP], {})
        s[f"{key}-defaults"] = (m[key], dict(EAGER, enable_prefix_caching=True, **GRAPHS, **CHUNKED), [GEN2, PLP], {})
    return s


@pytest.fixture(scope="module")
def engines(models):
    """engines(key): the JSON of that engine's run, run once (the first time a test asks)."""
    specs, runs = _specs(models), {}

    def get(key):
        if key.startswith("moe") and importlib.util.find_spec("vllm._moe_C_stable_libtorch") is None:
            pytest.skip("this vLLM has no MoE op library (vllm._moe_C_stable_libtorch)")
        if key not in runs:
            model, engine, jobs, extra = specs[key]
            runs[key] = run_engine(model, models["root"] / f"run-{key}.json", engine, jobs, **extra)
            assert runs[key]["quantization"] == ("kbit" if "dq" not in key else None)
        return runs[key]["jobs"]

    return get


def _gen(run, p=0):
    return run["gen"]["passes"][p]


def _check_greedy(ref, got, tol, what):
    problems = greedy_mismatches(ref, got, tol)
    assert not problems, f"{what}: greedy continuations differ beyond a near-tie:\n" + "\n".join(problems)


def _check_teacher_forced(ref, got, what, min_agreement=0.9, max_rel_diff=0.01):
    agreement, mean_diff = compare(ref, got)
    scale = logprob_scale(ref)
    print(f"{what}: top-1 agreement {agreement:.3f}, mean |dlogprob| {mean_diff:.4f} of mean |logprob| {scale:.2f}")
    assert agreement >= min_agreement and mean_diff < max_rel_diff * scale, what


# ----------------------------------------------------------------------------- engine features

def test_dense_prefix_caching_and_chunked_prefill(engines):
    ref, got = engines("llama4-eager"), engines("llama4-pc-chunked")
    cold, warm = got["gen"]["passes"]
    _check_greedy(_gen(ref), cold, SAME_WEIGHTS, "K=4 chunked prefill (64-token budget)")
    _check_greedy(_gen(ref), warm, SAME_WEIGHTS, "K=4 prefix-cache hits")
    long_ones = [c for c in warm if len(c["prompt_ids"]) > 64]
    assert long_ones and all(c["cached"] >= 32 for c in long_ones), \
        f"the second pass must find the first one's blocks: cached {[c['cached'] for c in warm]}"
    _check_teacher_forced(ref["plp"], got["plp"], "K=4 chunked prefill, teacher-forced")


def test_dense_cuda_graphs_and_torch_compile_match_eager(engines):
    ref, got = engines("llama4-eager"), engines("llama4-graphs")
    _check_greedy(_gen(ref), _gen(got), SAME_WEIGHTS, "K=4 CUDA graphs + torch.compile")
    _check_teacher_forced(ref["plp"], got["plp"], "K=4 CUDA graphs + torch.compile")


@pytest.mark.parametrize("name,bits", [("llama", 2), ("moe", 4), ("moe", 2)], ids=["dense-K2", "moe-K4", "moe-K2"])
def test_vllm_defaults_match_eager_without_caching(engines, name, bits):
    """vLLM's default engine (CUDA graphs + torch.compile, prefix caching, here chunked prefill
    with a 64-token budget) against eager without them; the second pass hits the prefix cache."""
    ref = engines(f"{name}{bits}-eager")
    got = engines(f"{name}{bits}-defaults")
    for p, run in enumerate(got["gen"]["passes"]):
        _check_greedy(_gen(ref), run, SAME_WEIGHTS, f"{name} K={bits} defaults, pass {p + 1}")
    warm = got["gen"]["passes"][1]
    assert any(c["cached"] >= 32 for c in warm), f"no prefix-cache hits: {[c['cached'] for c in warm]}"
    _check_teacher_forced(ref["plp"], got["plp"], f"{name} K={bits} defaults, teacher-forced")


@pytest.mark.parametrize("name", ["llama", "moe"], ids=["dense", "moe"])
def test_fp8_kv_cache(engines, name):
    ref, got = engines(f"{name}4-eager"), engines(f"{name}4-fp8kv")
    # FP8 (e4m3) keys and values move logprobs by their rounding; a wrong cache layout or scale
    # moves the top-1 token almost everywhere
    _check_greedy(_gen(ref), _gen(got), FP8_KV, f"{name} K=4 kv_cache_dtype fp8")
    _check_teacher_forced(ref["plp"], got["plp"], f"{name} K=4 kv_cache_dtype fp8",
                          min_agreement=0.75, max_rel_diff=0.1)


# ----------------------------------------------------------------------------- LoRA

def _subset(plp, idx):
    return {"prompt_logprobs": [plp["prompt_logprobs"][i] for i in idx],
            "prompt_ids": [plp["prompt_ids"][i] for i in idx]}


@pytest.mark.parametrize("name", ["llama", "moe"], ids=["dense", "moe"])
def test_lora_matches_bf16_of_dequantized_weights(engines, name):
    """Two random adapters and none in one batch, on kbit (vLLM's LoRA layers wrap the kbit
    layers' quant method) and on the bf16 model of the dequantized weights with the same
    adapters: the same per request, and each adapter changes the output far beyond that."""
    kb, dq = engines(f"{name}4-lora"), engines(f"{name}4dq-lora")
    by = {a: [i for i, x in enumerate(MIXED_LORAS) if x == a] for a in ("A", "B", None)}
    for a, idx in by.items():
        _check_greedy([_gen(dq)[i] for i in idx], [_gen(kb)[i] for i in idx], KBIT_VS_BF16,
                      f"{name} K=4 LoRA {a}")
        _check_teacher_forced(_subset(dq["plp"], idx), _subset(kb["plp"], idx), f"{name} K=4 LoRA {a}")
    _, kbit_noise = compare(_subset(dq["plp"], by["A"]), _subset(kb["plp"], by["A"]))
    for a in ("A", "B"):
        _, effect = compare(_subset(dq["plp"], by[None]), _subset(dq["plp"], by[a]))
        print(f"{name}: adapter {a} moves logprobs by {effect:.3f} (kbit against bf16: {kbit_noise:.3f})")
        assert effect > 5 * kbit_noise, f"adapter {a} must change the output far beyond kbit's rounding"


def test_moe_lora_on_experts_fails_clearly(models, tmp_path):
    """LoRA on kbit experts (vLLM wraps every supported module unless --lora-target-modules
    leaves the experts out) stops at load with an error that says what to do."""
    if importlib.util.find_spec("vllm._moe_C_stable_libtorch") is None:
        pytest.skip("this vLLM has no MoE op library (vllm._moe_C_stable_libtorch)")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": str(models["moe4"]), "engine": dict(EAGER, **LORA), "jobs": []}))
    p = subprocess.run([sys.executable, str(RUNNER), str(spec), str(tmp_path / "out.json")],
                       capture_output=True, text=True, timeout=600, env=RUNNER_ENV)
    assert p.returncode != 0, "LoRA on kbit experts must not start"
    log = p.stdout + p.stderr
    assert "kbit MoE layer" in log and "--lora-target-modules" in log, log[-3000:]


# ----------------------------------------------------------------------------- speculative decoding

@pytest.mark.parametrize("key", ["llama4-ngram", "llama4-draft"], ids=["dense-ngram", "dense-draft-model"])
def test_speculative_decoding_equals_plain_decoding(engines, models, key):
    """Greedy speculative decoding (n-gram proposals; a one-layer kbit draft for the kbit
    target) must give the target's own greedy continuations: the target verifies several
    tokens a step, through the same kbit layers."""
    ref, got = engines("llama4-eager"), engines(key)
    _check_greedy(_gen(ref), _gen(got), SAME_WEIGHTS, key)
    run = json.loads((models["root"] / f"run-{key}.json").read_text())
    drafts = {k: v for k, v in run.get("metrics", {}).items() if "num_draft" in k}
    print(f"{key}: {run.get('metrics')}")
    assert drafts and max(drafts.values()) > 0, f"{key}: no speculative drafts were made: {run.get('metrics')}"


# ----------------------------------------------------------------------------- structured output

def test_dense_structured_output(engines):
    texts = [t["text"] for t in engines("llama4-eager")["structured"]["texts"]]
    print(f"structured outputs: {texts}")
    assert texts[0] in ("alpha", "beta", "gamma"), texts[0]
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", texts[1]), texts[1]
    obj = json.loads(texts[2])
    assert set(obj) == {"answer", "color"} and obj["answer"] in ("yes", "no") and obj["color"] in ("red", "green", "blue")


# ----------------------------------------------------------------------------- OpenAI server

@pytest.fixture(scope="module")
def server(models, engines):
    engines("llama4-eager")  # the offline reference runs first: one engine on the GPU at a time
    s = Server(models["llama4"], SERVER_ARGS, models["root"] / "server.log")
    try:
        s.start()
        yield s
    finally:
        s.stop()


def _completion(server, prompt, **kw):
    status, body = server.post("/v1/completions", {"model": "kbit", "prompt": prompt, "max_tokens": 24,
                                                   "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
                                                   "return_tokens_as_token_ids": True, **kw})
    assert status == 200, body
    return body


def _entry(choice):
    """A completions choice as a compat_runner "generate" entry (steps: its top logprobs)."""
    top = (choice.get("logprobs") or {}).get("top_logprobs") or []
    return {"prompt_ids": choice["prompt_token_ids"], "ids": choice["token_ids"],
            "steps": [{k.removeprefix("token_id:"): v for k, v in step.items()} for step in top]}


def _check_logprobs(lp, n):
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert math.isfinite(chosen) and chosen <= 0 and len(top) >= 2
        assert chosen == pytest.approx(max(top.values()), abs=1e-4), "greedy picks the top token"


def test_server_completions_chat_and_streaming_match_offline(engines, server):
    ref = engines("llama4-eager")
    got = []
    for prompt in PROMPTS:
        body = _completion(server, prompt, logprobs=2)
        c = body["choices"][0]
        _check_logprobs(c["logprobs"], 24)
        assert body["usage"]["completion_tokens"] == 24
        got.append(_entry(c))
    _check_greedy(_gen(ref), got, SAME_WEIGHTS, "server /v1/completions")

    chats = []
    for messages in CHATS:
        status, body = server.post("/v1/chat/completions", {
            "model": "kbit", "messages": messages, "max_tokens": 16, "temperature": 0.0, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 2, "return_token_ids": True})
        assert status == 200, body
        c = body["choices"][0]
        assert c["message"]["role"] == "assistant" and len(c["logprobs"]["content"]) == 16
        chats.append({"prompt_ids": body["prompt_token_ids"], "ids": c["token_ids"]})
    _check_greedy(ref["chat"]["passes"][0], chats, SAME_WEIGHTS, "server /v1/chat/completions (chat template)")

    plain = _completion(server, PROMPTS[1])["choices"][0]["text"]
    events = server.stream("/v1/completions", {"model": "kbit", "prompt": PROMPTS[1], "max_tokens": 24,
                                               "temperature": 0.0, "ignore_eos": True})
    assert len(events) > 1 and "".join(e["choices"][0]["text"] for e in events if e["choices"]) == plain


def test_server_n_greater_than_one(server):
    greedy = _entry(_completion(server, PROMPTS[0], logprobs=5)["choices"][0])
    # top_k = 1 samples the argmax: every one of the n choices is the greedy continuation (up to
    # near-ties: three sequences a step instead of one)
    body = _completion(server, PROMPTS[0], n=3, temperature=1.0, top_k=1, seed=0)
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2]
    _check_greedy([greedy] * 3, [_entry(c) for c in body["choices"]], SAME_WEIGHTS, "n = 3 with top_k = 1")
    body = _completion(server, PROMPTS[0], n=3, temperature=1.0, seed=0, logprobs=1)
    assert len(body["choices"]) == 3 and body["usage"]["completion_tokens"] == 3 * 24
    for c in body["choices"]:
        assert all(math.isfinite(x) for x in c["logprobs"]["token_logprobs"])


def test_server_long_prompt_at_32k(server, models):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(models["llama4"] / "tokenizer.json"))
    ids = []
    while len(ids) <= 32768:
        ids += tok.encode(" ".join(PROMPTS)).ids
    prompt = ids[:32768 - 64]
    body = _completion(server, prompt, max_tokens=16, logprobs=2)
    assert body["usage"]["prompt_tokens"] == len(prompt) and body["usage"]["completion_tokens"] == 16
    _check_logprobs(body["choices"][0]["logprobs"], 16)
    # one token more than max_model_len: a clear 400, and the server stays up
    status, err = server.post("/v1/completions", {"model": "kbit", "prompt": ids[:32769], "max_tokens": 1})
    assert status == 400, err
    assert _completion(server, PROMPTS[0], max_tokens=4)["usage"]["completion_tokens"] == 4
