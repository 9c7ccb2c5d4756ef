"""vLLM end to end on architectures other than Llama (vllm_kbit.synthetic.ARCHITECTURES): each
reaches our linear layers in its own way (q/k/v biases, q/k norms, projections fused in the
checkpoint, GeGLU and soft-capping with tied embeddings, MoE models with kbit experts beside
float routers, a kbit shared expert, MLA attention). For each, a random model converted to kbit K=4 runs in
vllm.LLM against the same model with the dequantized weights in bf16, teacher-forced over the
prompts (e2e_common.compare), as tests/test_e2e_gpu.py does for Llama (which it covers with
CUDA graphs, TP=2 and a kbit lm_head; here every engine is eager, to keep the file short).
Tensor parallel (two GPUs) must match one GPU for the biased and fused-checkpoint models.
Online quantization (`--quantization kbit` on the float checkpoint) must give what the
converted checkpoint gives, for the fused-checkpoint and MoE models. MoE models need vLLM's MoE op
library (vllm._moe_C_stable_libtorch): skipped where this vLLM has none."""
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm")

from vllm_kbit.convert import convert  # noqa: E402
from vllm_kbit.synthetic import ARCHITECTURES, MOE_ARCHITECTURES, make_random_model  # noqa: E402

from e2e_common import compare, dequantized_copy, logprob_scale, run  # noqa: E402

ARCHS = sorted(a for a in ARCHITECTURES if a != "llama")
MOE = MOE_ARCHITECTURES


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    arch = request.param
    if arch in MOE and importlib.util.find_spec("vllm._moe_C_stable_libtorch") is None:
        pytest.skip("this vLLM has no MoE op library (vllm._moe_C_stable_libtorch), so no MoE model runs; "
                    "test_convert covers the conversion")
    root = tmp_path_factory.mktemp(arch)
    # init_std 0.08 as in test_e2e_gpu: peaked enough next-token distributions for top-1
    src = make_random_model(root / "src", arch=arch, hidden_size=512, intermediate_size=1024, num_layers=2,
                            num_heads=8, num_kv_heads=4, vocab_size=512, init_std=0.08)
    report = convert(src, root / "kbit4", 4, progress=False)
    assert report.quantized and not report.used_heuristic
    return arch, src, root / "kbit4", dequantized_copy(root / "kbit4", root / "dequant")


def test_kbit_matches_bf16_of_dequantized_weights(model):
    arch, _, kbit, dequant = model
    ref = run(dequant, "eager", "--eager")
    got = run(kbit, "eager", "--eager")
    assert got["quantization"] == "kbit" and ref["quantization"] is None
    agreement, mean_diff = compare(ref, got)
    scale = logprob_scale(ref)
    print(f"{arch}: top-1 agreement {agreement:.3f}, mean |dlogprob| {mean_diff:.4f} of mean |logprob| {scale:.2f}")
    # Relative: these random models' prompt tokens sit at very different logprobs (Gemma 2:
    # mean |logprob| 24.5, its kernels-vs-cuBLAS difference 0.063 with the same bf16 weights on
    # both sides, i.e. 0.26%; H200, 2026-11-22). A wrong fragment or scale moves top-1 instead.
    assert agreement >= 0.9 and mean_diff < 0.01 * scale
    first = sum(g[:4] == r[:4] for g, r in zip(got["greedy"], ref["greedy"]))
    assert first >= len(ref["greedy"]) - 1, "greedy continuations must agree on their first steps"


def test_online_quantization_equals_the_converted_checkpoint(model):
    arch, src, kbit, _ = model
    if arch not in ("phi3",) + MOE:
        pytest.skip("online quantization: the fused-checkpoint and MoE models only (Llama: test_vllm_layers)")
    got = run(src, "online", "--eager", "--quantization", "kbit")
    ref = run(kbit, "eager", "--eager", reuse=True)
    assert got["quantization"] == "kbit"
    agreement, mean_diff = compare(ref, got)
    print(f"{arch}: online against converted: top-1 agreement {agreement:.3f}, mean |dlogprob| {mean_diff:.2e}")
    # the CUDA quantizer is bit-exact with the converter's (test_kernels_gpu), so the engines
    # hold the same weights and run the same kernels
    assert got["greedy"] == ref["greedy"] and agreement == 1.0 and mean_diff == 0.0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tensor_parallel_2_equals_1(model):
    """TP = 2 against TP = 1 where the ranks' shards come about differently: Qwen2's q/k/v biases
    split with the rows, Phi-3's fused checkpoint tensors split into q/k/v (gate/up) and then
    over the ranks."""
    arch, _, kbit, _ = model
    if arch not in ("qwen2", "phi3"):
        pytest.skip("tensor parallel: the biased and the fused-checkpoint models only (Llama: test_e2e_gpu)")
    one = run(kbit, "eager", "--eager", reuse=True)
    two = run(kbit, "tp2", "--eager", "--tp", "2")
    agreement, mean_diff = compare(one, two)
    print(f"{arch} TP=2 vs TP=1: top-1 agreement {agreement:.3f}, mean |dlogprob| {mean_diff:.4f}")
    assert agreement >= 0.95 and mean_diff < 0.02
