"""The CPU side of tests/test_compat_gpu.py: the random LoRA adapter loads through vLLM's own
adapter loader with the shapes and scaling vLLM applies; the greedy comparison accepts
near-ties only; every engine the GPU file starts has arguments vLLM accepts; and LoRA on kbit
experts stops with an error that says what to do."""
import json
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_kbit.synthetic import make_random_model  # noqa: E402

from compat_common import ATTENTION, MLP, greedy_mismatches, lora_shapes, write_lora_adapter  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_random_model(tmp_path_factory.mktemp("llama") / "m", hidden_size=256, intermediate_size=512,
                             num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=300)


def test_lora_adapter_loads_through_vllm(llama, tmp_path, monkeypatch):
    from vllm.lora import lora_model
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    monkeypatch.setattr(lora_model, "PIN_MEMORY", False)  # pinned host memory needs a GPU

    dst = write_lora_adapter(tmp_path / "a", llama, rank=8, alpha=16, seed=3)
    peft = PEFTHelper.from_local_dir(str(dst), max_position_embeddings=2048)
    assert peft.r == 8 and peft.vllm_lora_scaling_factor == 2.0
    model = LoRAModel.from_local_checkpoint(str(dst), set(ATTENTION + MLP), peft, lora_model_id=1,
                                            device="cpu", dtype=torch.bfloat16)
    config = json.loads((llama / "config.json").read_text())
    shapes = lora_shapes(config)
    assert len(model.loras) == config["num_hidden_layers"] * len(ATTENTION + MLP)
    for layer in range(config["num_hidden_layers"]):
        for t, (out, inp) in shapes.items():
            block = "self_attn" if t in ATTENTION else "mlp"
            lw = model.loras[f"model.layers.{layer}.{block}.{t}"]
            assert tuple(lw.lora_a.shape) == (8, inp) and tuple(lw.lora_b.shape) == (out, 8)
            assert lw.lora_a.abs().sum() > 0 and lw.lora_b.abs().sum() > 0
    # a second seed is another adapter
    other = write_lora_adapter(tmp_path / "b", llama, ATTENTION, seed=4)
    from safetensors.torch import load_file
    a, b = load_file(dst / "adapter_model.safetensors"), load_file(other / "adapter_model.safetensors")
    assert set(b) < set(a)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert not torch.equal(a[key], b[key])


def test_lora_adapter_rejects_unknown_targets(llama, tmp_path):
    with pytest.raises(ValueError, match="unknown targets.*qkv_proj"):
        write_lora_adapter(tmp_path / "a", llama, ("qkv_proj",))


def _entry(ids, steps, prompt=(1, 2, 3)):
    return {"prompt_ids": list(prompt), "ids": ids, "steps": steps}


def test_greedy_mismatches_accepts_near_ties_only():
    steps = [{"5": -0.1, "6": -2.5}, {"7": -0.70, "8": -0.72}, {"9": -0.2, "3": -3.0}]
    ref = [_entry([5, 7, 9], steps)]
    assert greedy_mismatches(ref, [_entry([5, 7, 9], [])], 0.1) == []
    assert greedy_mismatches(ref, [_entry([5, 8, 1], [])], 0.1) == []  # a near-tie at step 1, then anything
    assert "below" in greedy_mismatches(ref, [_entry([6, 7, 9], [])], 0.1)[0]  # a clear gap at step 0
    assert "top tokens" in greedy_mismatches(ref, [_entry([5, 7, 4], [])], 0.1)[0]  # outside the top
    assert "prompt tokens" in greedy_mismatches(ref, [_entry([5, 7, 9], [], prompt=(1, 2))], 0.1)[0]
    assert "tokens against" in greedy_mismatches(ref, [_entry([5, 7], [])], 0.1)[0]
    with pytest.raises(ValueError):
        greedy_mismatches(ref, [], 0.1)


def test_gpu_engines_take_arguments_vllm_accepts(tmp_path):
    """Every engine of test_compat_gpu as EngineArgs, and its nested configs, built here: a
    misspelt argument fails on the CPU, not in the one GPU run."""
    from vllm.config import CompilationConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.sampling_params import StructuredOutputsParams

    import test_compat_gpu as gpu

    names = ["llama4", "llama2", "llama4dq", "moe4", "moe2", "moe4dq", "draft4", "lora-A", "lora-B",
             "moe-lora-A", "moe-lora-B", "root"]
    specs = gpu._specs({n: tmp_path / n for n in names})
    assert {"llama4-eager", "llama4-pc-chunked", "llama4-graphs", "llama4-fp8kv", "llama4-lora", "llama4dq-lora",
            "llama4-ngram", "llama4-draft", "llama2-eager", "llama2-defaults",
            "moe4-eager", "moe4-defaults", "moe2-eager", "moe2-defaults", "moe4-fp8kv", "moe4-lora",
            "moe4dq-lora"} == set(specs)
    for key, (model, engine, jobs, extra) in specs.items():
        args = EngineArgs(model=str(model), **engine)
        if "compilation_config" in engine:
            CompilationConfig(**engine["compilation_config"])
        assert args.enforce_eager == ("graphs" not in key and "defaults" not in key), key
        assert set(extra) <= {"adapters", "metrics"}
        for job in jobs:
            assert job["kind"] in ("generate", "prompt_logprobs", "chat", "structured")
            if "loras" in job:
                assert len(job["loras"]) == len(job["prompts"]) and set(job["loras"]) <= {"A", "B", None}
                assert set(extra["adapters"]) == {"A", "B"}
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    server = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "m", *gpu.SERVER_ARGS])
    assert server.max_model_len == 32768 and server.enforce_eager and server.enable_prefix_caching is False
    assert server.served_model_name == ["kbit"]
    for case in gpu.STRUCTURED["cases"]:
        StructuredOutputsParams(**case)
    # the chunked engines really chunk the long prompts, and the reference does not
    assert specs["llama4-pc-chunked"][1]["max_num_batched_tokens"] == 64
    assert specs["llama4-eager"][1]["max_num_batched_tokens"] >= 4096


def test_lora_on_kbit_experts_says_what_to_do():
    from vllm_kbit.moe import KbitMoEMethod

    method = SimpleNamespace(prefix="model.layers.0.mlp.experts")
    with pytest.raises(ValueError, match=r"kbit MoE layer model\.layers\.0\.mlp\.experts.*--lora-target-modules"):
        KbitMoEMethod.select_gemm_impl(method, None, None)


_FAKE_SERVER = r'''
import json, sys, time
from http.server import BaseHTTPRequestHandler, HTTPServer

time.sleep(1.0)  # not up at once: start() polls


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("max_tokens", 0) > 100:
            out = json.dumps({"error": {"message": "too long"}}).encode()
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(out)
            return
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for piece in ("ab", "c"):
                self.wfile.write(("data: " + json.dumps({"choices": [{"text": piece}]}) + "\n\n").encode())
            self.wfile.write(b"data: [DONE]\n\n")
            return
        out = json.dumps({"echo": body}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(out)


HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), H).serve_forever()
'''


def test_server_client_starts_posts_streams_and_stops(tmp_path):
    """compat_common.Server against a stand-in HTTP server: the bounded wait for /health, JSON
    posts (an HTTP error comes back as its status and body), server-sent events up to [DONE],
    and the process group stopped."""
    import sys

    from compat_common import Server

    script = tmp_path / "fake.py"
    script.write_text(_FAKE_SERVER)
    s = Server(tmp_path / "model", ["--x"], tmp_path / "log", command=(sys.executable, str(script)))
    try:
        s.start(timeout=60)
        assert s.post("/v1/completions", {"max_tokens": 3}) == (200, {"echo": {"max_tokens": 3}})
        status, err = s.post("/v1/completions", {"max_tokens": 1000})
        assert status == 400 and err["error"]["message"] == "too long"
        assert [e["choices"][0]["text"] for e in s.stream("/v1/completions", {})] == ["ab", "c"]
    finally:
        s.stop()
    assert s.proc.returncode is not None


def test_server_start_reports_an_early_exit(tmp_path):
    import sys

    from compat_common import Server

    s = Server(tmp_path / "model", [], tmp_path / "log", command=(sys.executable, "-c", "raise SystemExit(3)"))
    try:
        with pytest.raises(RuntimeError, match="exited with 3"):
            s.start(timeout=60)
    finally:
        s.stop()


class _FakeLLM:
    """vllm.LLM's surface that compat_runner uses: each prompt's continuation is its length
    repeated, the top logprobs a step name that token and the next one."""

    def __init__(self, model, **engine):
        from vllm.v1.metrics.reader import Counter
        self.engine = engine
        self.calls = []
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(quantization="kbit")))
        self.metrics = [Counter(name="vllm:spec_decode_num_drafts", labels={}, value=7)]

    def _out(self, prompt, sp):
        from vllm.logprobs import Logprob
        ids = [1, 2, 3] if not isinstance(prompt, str) else [1] + [ord(c) % 50 for c in prompt[:4]]
        tok = [len(ids)] * sp.max_tokens
        steps = [{t: Logprob(-0.5), t + 1: Logprob(-1.5)} for t in tok] if sp.logprobs else None
        plp = [None] + [{i: Logprob(-1.0, rank=1)} for i in ids[1:]] if sp.prompt_logprobs else None
        text = "abc" if sp.structured_outputs is None else json.dumps(sp.structured_outputs.choice)
        return SimpleNamespace(prompt_token_ids=ids, num_cached_tokens=5, prompt_logprobs=plp,
                               outputs=[SimpleNamespace(token_ids=tok, text=text, logprobs=steps, finish_reason="stop")])

    def generate(self, prompts, sp, lora_request=None, use_tqdm=True):
        self.calls.append(lora_request)
        return [self._out(p, sp) for p in prompts]

    def chat(self, messages, sp, use_tqdm=True):
        return [self._out(m[-1]["content"], sp) for m in messages]

    def get_metrics(self):
        return self.metrics


def test_runner_writes_what_the_gpu_tests_read(tmp_path, monkeypatch):
    import sys

    import compat_runner
    import vllm

    made = []
    monkeypatch.setattr(vllm, "LLM", lambda model, **kw: made.append(_FakeLLM(model, **kw)) or made[-1])
    spec = {"model": "m", "engine": {"seed": 0}, "adapters": {"A": str(tmp_path / "a"), "B": str(tmp_path / "b")},
            "metrics": True, "jobs": [
                {"name": "gen", "kind": "generate", "prompts": ["hello", {"prompt_token_ids": [1, 2, 3]}],
                 "max_tokens": 3, "logprobs": 5, "passes": 2, "loras": ["B", None]},
                {"name": "plp", "kind": "prompt_logprobs", "prompts": ["hello"]},
                {"name": "chat", "kind": "chat", "messages": [[{"role": "user", "content": "hi"}]], "max_tokens": 2},
                {"name": "so", "kind": "structured", "prompt": "x", "cases": [{"choice": ["a", "b"]}]}]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    monkeypatch.setattr(sys, "argv", ["compat_runner.py", str(tmp_path / "spec.json"), str(tmp_path / "out.json")])
    compat_runner.main()
    out = json.loads((tmp_path / "out.json").read_text())
    assert made[0].engine == {"seed": 0} and out["quantization"] == "kbit"
    lora = made[0].calls[0]
    assert [r.lora_name if r else None for r in lora] == ["B", None] and lora[0].lora_int_id == 2
    assert lora[0].lora_path == str(tmp_path / "b")
    gen = out["jobs"]["gen"]["passes"]
    assert len(gen) == 2 and gen[0][1] == {"prompt_ids": [1, 2, 3], "ids": [3, 3, 3], "text": "abc",
                                            "steps": [{"3": -0.5, "4": -1.5}] * 3, "cached": 5}
    assert greedy_mismatches(gen[0], gen[1], 0.0) == []
    plp = out["jobs"]["plp"]
    assert plp["prompt_logprobs"][0][0] is None and plp["prompt_logprobs"][0][1] == {str(ord("h") % 50): [-1.0, 1]}
    assert len(out["jobs"]["chat"]["passes"][0][0]["ids"]) == 2
    assert out["jobs"]["so"]["texts"] == [{"text": '["a", "b"]', "finish_reason": "stop"}]
    assert out["metrics"] == {"vllm:spec_decode_num_drafts": 7}
