"""MoE models with kbit experts end to end on a GPU with real vLLM: random Qwen2-MoE, Qwen3-MoE
and Mixtral models converted to kbit, served by vllm.LLM with torch.compile + CUDA graphs,
against the same models in bf16 with the *dequantized* weights (eager), teacher-forced over the
prompts (e2e_common.compare), as tests/test_e2e_gpu.py does for Llama. Eager runs of every
synthetic architecture, DeepSeek-V3 (MLA) included, and online quantization are in
tests/test_architectures_gpu.py; the MoE layer alone in a CUDA graph in tests/test_moe.py."""
import importlib.util
import math

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm")

from vllm_kbit.convert import convert  # noqa: E402
from vllm_kbit.synthetic import make_random_model  # noqa: E402

from e2e_common import compare, dequantized_copy, logprob_scale, run  # noqa: E402


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe", "mixtral"])
def arch_root(request, tmp_path_factory):
    if importlib.util.find_spec("vllm._moe_C_stable_libtorch") is None:
        pytest.skip("this vLLM has no MoE op library (vllm._moe_C_stable_libtorch)")
    root = tmp_path_factory.mktemp(request.param)
    # init_std 0.08 as in test_e2e_gpu: peaked enough next-token distributions for top-1;
    # expert intermediate 512 (Mixtral 1024): whole 64-wide tiles
    src = make_random_model(root / "src", arch=request.param, hidden_size=512, intermediate_size=1024,
                            num_layers=2, num_heads=8, num_kv_heads=4, vocab_size=512, init_std=0.08)
    return request.param, root, src


@pytest.mark.parametrize("bits", [2, 4])
def test_kbit_experts_match_bf16_of_dequantized_weights(arch_root, bits):
    arch, root, src = arch_root
    kbit = root / f"kbit{bits}"
    report = convert(src, kbit, bits, progress=False)
    assert any(".experts." in n for n in report.quantized)
    dequant = dequantized_copy(kbit, root / f"dequant{bits}")
    ref = run(dequant, "eager", "--eager")
    got = run(kbit, "graphs")  # default: torch.compile + CUDA graphs
    assert got["quantization"] == "kbit" and ref["quantization"] is None
    agreement, mean_diff = compare(ref, got)
    scale = logprob_scale(ref)
    print(f"{arch} K={bits}: top-1 agreement {agreement:.3f}, mean |dlogprob| {mean_diff:.4f} "
          f"of mean |logprob| {scale:.2f}")
    assert agreement >= 0.9 and mean_diff < 0.01 * scale
    first = sum(g[:4] == r[:4] for g, r in zip(got["greedy"], ref["greedy"]))
    assert first >= len(ref["greedy"]) - 1, "greedy continuations must agree on their first steps"


def test_dummy_weights_serve(arch_root):
    """--load-format dummy on the float model with --quantization kbit: random valid kbit experts."""
    _, _, src = arch_root
    got = run(src, "dummy", "--quantization", "kbit", "--load-format", "dummy")
    assert got["quantization"] == "kbit" and all(len(g) > 0 for g in got["greedy"])
    logprobs = [lp for prompt in got["prompt_logprobs"] for pos in prompt if pos for lp, _ in pos.values()]
    assert logprobs and all(math.isfinite(lp) for lp in logprobs), "dummy kbit experts must give finite logits"
