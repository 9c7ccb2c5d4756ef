"""Convert a Hugging Face model folder to a kbit checkpoint with the Python API.

    python examples/convert_hf_model.py SRC DST --bits 4 [--ignore model.layers.0.mlp.down_proj]
    python examples/convert_hf_model.py --demo DST --bits 3     # SRC: a tiny random Llama
    python examples/convert_hf_model.py SRC DST --bits 4 --quantize-lm-head   # lm_head kbit too

The CLI equivalent is `python -m vllm_kbit.convert SRC DST --bits 4`. Serve the result with
`vllm serve DST` (the plugin reads quantization_config from DST/config.json).
"""
import argparse
import tempfile
from pathlib import Path

from vllm_kbit.convert import convert


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", metavar="SRC DST", help="SRC DST, or just DST with --demo")
    parser.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 5))
    parser.add_argument("--ignore", action="append", default=[], help="module name or 're:REGEX' to keep unquantized")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--quantize-lm-head", action="store_true", help="lm_head kbit too (not for tied embeddings)")
    parser.add_argument("--demo", action="store_true", help="convert a freshly made tiny random Llama")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        if args.demo:
            from vllm_kbit.synthetic import make_random_llama

            (dst,) = args.paths
            src = make_random_llama(Path(tmp) / "random-llama", hidden_size=256, intermediate_size=512)
        else:
            src, dst = args.paths
        report = convert(src, dst, args.bits, ignore=args.ignore, overwrite=args.overwrite,
                         quantize_lm_head=args.quantize_lm_head)

    print(report.summary())
    print(f"ignore list in {dst}/config.json: {report.ignore}")


if __name__ == "__main__":
    main()
