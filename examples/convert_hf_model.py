"""Convert a Hugging Face model folder to a kbit checkpoint with the Python API.

    python examples/convert_hf_model.py SRC DST --bits 4 [--ignore model.layers.0.mlp.down_proj]
    python examples/convert_hf_model.py --demo DST --bits 3     # SRC: a tiny random Llama
    python examples/convert_hf_model.py SRC DST --bits 4 --quantize-lm-head   # lm_head kbit too

The CLI equivalent is `python -m vllm_kbit.convert SRC DST --bits 4`. Serve the result with
`vllm serve DST` (the plugin reads quantization_config from DST/config.json).
"""
import argparse
import sys
import tempfile
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s SRC DST [options] | %(prog)s --demo DST [options]")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="SRC DST, or just DST with --demo")
    parser.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 5))
    parser.add_argument("--ignore", action="append", default=[], help="module name or 're:REGEX' to keep unquantized")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--quantize-lm-head", action="store_true", help="lm_head kbit too (not for tied embeddings)")
    parser.add_argument("--demo", action="store_true", help="convert a freshly made tiny random Llama")
    args = parser.parse_args()
    if len(args.paths) != (1 if args.demo else 2):
        parser.error("--demo takes DST only (it makes SRC)" if args.demo else "give SRC and DST (or --demo DST)")
    from vllm_kbit.convert import CLI_ERRORS, cli_error, cli_spelling, convert  # (torch: after the usage checks)

    try:  # cli_spelling: errors name this script's options (--overwrite), not convert()'s (overwrite=True)
        with tempfile.TemporaryDirectory() as tmp, cli_spelling():
            if args.demo:
                from vllm_kbit.synthetic import make_random_llama

                (dst,) = args.paths
                src = make_random_llama(Path(tmp) / "random-llama", hidden_size=256, intermediate_size=512)
            else:
                src, dst = args.paths
            report = convert(src, dst, args.bits, ignore=args.ignore, overwrite=args.overwrite,
                             quantize_lm_head=args.quantize_lm_head)
    except (*CLI_ERRORS, KeyboardInterrupt) as e:  # one line, as `python -m vllm_kbit.convert` says it
        return cli_error(e)

    print(report.summary())
    print(f"ignore list in {dst}/config.json: {report.ignore}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
