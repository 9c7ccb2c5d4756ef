"""Shared by the compatibility tests (tests/test_compat_gpu.py, tests/test_compat.py): the
prompts, a random PEFT LoRA adapter for a model folder, the greedy-continuation comparison,
one engine run through tests/compat_runner.py, and a bounded OpenAI-server client."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import save_file

RUNNER = Path(__file__).with_name("compat_runner.py")
# the engine core in the runner's own process: one process start and vLLM import an engine
RUNNER_ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}

# Short prompts, and long ones: longer than a chunked-prefill budget of 64 tokens, sharing
# prefixes of several 16-token KV blocks (prefix caching), with repeats an n-gram drafter finds.
_STORY = ("Once upon a time, in a small village by the sea, there lived an old fisherman and his wife. "
          "Every morning he rowed out past the harbour wall, and every evening he came home with the tide. ")
_CODE = "def main():\n    for i in range(10):\n        print(f\"step {i}: loss={1.0 / (i + 1):.3f}\")\n    return 0\n"
SHORT_PROMPTS = [
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins",
    "Language models predict the next token from the tokens that came before it, and",
]
LONG_PROMPTS = [
    _STORY * 3 + "The capital of France is",
    _STORY * 3 + "Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64",
    _CODE * 4 + "def main():\n    for",
]
PROMPTS = SHORT_PROMPTS + LONG_PROMPTS
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Tell me a story about the sea."}],
]

# LoRA targets: vLLM's names of the projections in a PEFT adapter (Llama / Qwen3-MoE)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


# ----------------------------------------------------------------------------- LoRA adapter

def lora_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each LoRA target of a Llama-like model config (config.json as a dict)."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def write_lora_adapter(dst, model_dir, targets=ATTENTION + MLP, rank: int = 8, alpha: int = 16,
                       std_b: float = 0.08, seed: int = 0) -> Path:
    """A random PEFT LoRA adapter for the model in `model_dir` (config.json): adapter_config.json
    and adapter_model.safetensors with PEFT's key names
    (base_model.model.model.layers.L.{self_attn,mlp}.P.lora_{A,B}.weight, A [rank, in],
    B [out, rank], bf16), on the projections `targets` of every layer. A ~ N(0, 1/in) and
    B ~ N(0, std_b^2): with alpha / rank = 2 the update moves a projection's output by a
    fraction of the base one, enough to change the next-token choices of a random model."""
    dst = Path(dst)
    dst.mkdir(parents=True)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    shapes = lora_shapes(config)
    unknown = set(targets) - set(shapes)
    if unknown:
        raise ValueError(f"write_lora_adapter: unknown targets {sorted(unknown)}; known: {sorted(shapes)}")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for t in targets:
            out, inp = shapes[t]
            block = "self_attn" if t in ATTENTION else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{t}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=gen) / inp ** 0.5).to(torch.bfloat16)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=gen) * std_b).to(torch.bfloat16)
    save_file(tensors, dst / "adapter_model.safetensors", metadata={"format": "pt"})
    (dst / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model_dir),
        "r": rank, "lora_alpha": alpha, "target_modules": list(targets), "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
        "use_dora": False}, indent=2))
    return dst


# ----------------------------------------------------------------------------- comparisons

def greedy_mismatches(ref: list[dict], got: list[dict], tol: float) -> list[str]:
    """Greedy continuations `got` against `ref` (compat_runner "generate" entries, one per
    prompt, with each step's top logprobs): where two continuations first differ, the two
    tokens must be a near-tie in `ref` (their logprobs within `tol`); a token outside ref's
    top logprobs there, or a clear gap, is a wrong answer. Returns what is wrong, per prompt."""
    problems = []
    for p, (r, g) in enumerate(zip(ref, got, strict=True)):
        if r["prompt_ids"] != g["prompt_ids"]:
            problems.append(f"prompt {p}: different prompt tokens")
            continue
        i = next((i for i, (a, b) in enumerate(zip(r["ids"], g["ids"])) if a != b), None)
        if i is None:
            if len(r["ids"]) != len(g["ids"]):
                problems.append(f"prompt {p}: {len(g['ids'])} tokens against {len(r['ids'])}")
            continue
        step = r["steps"][i]
        a, b = str(r["ids"][i]), str(g["ids"][i])
        if b not in step:
            problems.append(f"prompt {p} step {i}: token {b} is not among the reference's top tokens {step}")
        elif step[a] - step[b] > tol:
            problems.append(f"prompt {p} step {i}: token {b} is {step[a] - step[b]:.3f} below the "
                            f"reference's {a} (a near-tie is within {tol})")
    return problems


# ----------------------------------------------------------------------------- engines

def run_engine(model: Path, out: Path, engine: dict, jobs: list[dict], adapters: dict | None = None,
               metrics: bool = False, timeout: int = 600) -> dict:
    """compat_runner.py on `model` with LLM(**engine); its JSON (also kept as `out`)."""
    spec = out.with_suffix(".spec.json")
    spec.write_text(json.dumps({"model": str(model), "engine": engine, "jobs": jobs,
                                "adapters": {k: str(v) for k, v in (adapters or {}).items()},
                                "metrics": metrics}))
    subprocess.run([sys.executable, str(RUNNER), str(spec), str(out)], check=True, timeout=timeout, env=RUNNER_ENV)
    return json.loads(out.read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`vllm serve` (the OpenAI server) on 127.0.0.1 in its own process group,
    started by `start` (bounded wait for /health) and always stopped by `stop`."""

    COMMAND = (sys.executable, "-m", "vllm.entrypoints.cli.main", "serve")

    def __init__(self, model: Path, args: list[str], log: Path, command=COMMAND):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [*command, str(model), "--host", "127.0.0.1", "--port", str(self.port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, timeout: float = 300.0) -> None:
        import time
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the OpenAI server exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"the OpenAI server did not answer /health in {timeout:.0f} s (log: {self.log.name})")

    def stop(self) -> None:
        import signal
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self.log.close()

    def post(self, path: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
        """(HTTP status, JSON body) of a POST."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def stream(self, path: str, body: dict, timeout: float = 120.0) -> list[dict]:
        """The server-sent events of a streamed POST, up to "data: [DONE]"."""
        req = urllib.request.Request(self.url + path, data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        events = []
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return events
                events.append(json.loads(line[len("data: "):]))
        raise AssertionError("the stream ended without data: [DONE]")
