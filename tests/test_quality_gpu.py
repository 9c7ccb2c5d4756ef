"""A rotated checkpoint (convert --rotate) and a mixed-K one (convert --bits 2.5: K per layer
from bits_per_layer) of a random Llama, served by vLLM on a GPU, against a bf16 run of their
own dequantized weights: the loader must give every layer its own K and codebook, and the
rotated checkpoint must load as the ordinary architecture it is."""
import json
import random

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("vllm")

from vllm_kbit.convert import convert  # noqa: E402
from vllm_kbit.synthetic import make_random_llama  # noqa: E402

from e2e_common import compare, dequantized_copy, run  # noqa: E402

CASES = {"rotated-K3": dict(bits=3, rotate=True), "mixed-2.5": dict(bits=2.5)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    # hidden 384 = 128 x 3: the rotation's Kronecker case; init_std 0.08: peaked distributions
    src = make_random_llama(root / "src", hidden_size=384, intermediate_size=1024, num_layers=3,
                            num_heads=6, num_kv_heads=2, vocab_size=512, init_std=0.08)
    words = "the quick brown fox jumps over a lazy dog while language models predict tokens".split()
    calib = root / "calib.txt"
    calib.write_text(" ".join(random.Random(0).choice(words) for _ in range(6000)))
    out = {}
    for name, kw in CASES.items():
        kbit = root / name
        extra = {} if kw.get("rotate") else dict(calib=str(calib), calib_samples=4)
        convert(src, kbit, progress=False, **kw, **extra)
        out[name] = (kbit, dequantized_copy(kbit, root / f"dequant-{name}"))
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_served_equals_bf16_of_dequantized_weights(models, name):
    kbit, dequant = models[name]
    qc = json.loads((kbit / "config.json").read_text())["quantization_config"]
    if name.startswith("mixed"):  # more than one K, fused groups included, or the test is moot
        assert len(set(qc["bits_per_layer"].values())) > 1
    ref = run(dequant, "eager", "--eager")
    got = run(kbit, "eager", "--eager")
    assert got["quantization"] == "kbit" and ref["quantization"] is None
    agreement, mean_diff = compare(ref, got)
    print(f"{name}: top-1 agreement {agreement:.3f}, mean |dlogprob| {mean_diff:.4f}")
    assert agreement >= 0.95 and mean_diff < 0.05
