"""Quantization algorithms that write the kbit format (used by `convert` and the quality
benchmark): codebooks (codebooks.py), block-scale search (scales.py), rtn / mse / gptq
rounding (rounding.py) and the sequential calibration run gptq needs (calibrate.py)."""
from vllm_kbit.quant.codebooks import default_codebook, fit_codebook, named_codebook, nf0_codebook  # noqa: F401
from vllm_kbit.quant.rounding import METHODS, quantize_gptq, quantize_mse, quantize_rtn, quantize_weight  # noqa: F401
