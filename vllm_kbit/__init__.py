"""vllm_kbit: k-bit codebook weight quantization (K = 2..5, blocks of 32, E4M4 absmax) for vLLM."""

__version__ = "0.1.0"


def register() -> None:
    """vLLM general-plugin entry point: registers the `kbit` quantization method.

    Runs in every vLLM process (API server, engine core, workers); it is idempotent, cheap,
    and never initialises CUDA.
    """
    from vllm_kbit import config  # noqa: F401  (the decorator registers "kbit")
