"""Side-by-side table of bench_decode.py runs made under different settings in one sitting on one GPU
(same-call A/B): each LABEL=DIR names a folder of bench_decode_*.json files (several runs of
one setting are averaged, so alternate the settings and run each twice). Prints one row per
(method, M, layer) with the µs of each label and its ratio to the first label.
usage: python3 scripts/ab_summary.py LABEL=DIR [LABEL=DIR ...] [--what step|all]
"""
import glob
import json
import os
import statistics
import sys


def load(folder):
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "bench_decode_*.json"))):
        with open(path) as f:
            for r in json.load(f)["results"]:
                runs.setdefault((r["method"], r["m"], r["what"]), []).append(r["us"])
    return {key: statistics.mean(v) for key, v in runs.items()}


def main(argv):
    what = "step"
    if "--what" in argv:
        i = argv.index("--what")
        what = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    labels, data = [], []
    for spec in argv:
        label, folder = spec.split("=", 1)
        labels.append(label)
        data.append(load(folder))
    keys = sorted({k for d in data for k in d if what == "all" or k[2] == what},
                  key=lambda k: (k[0], k[1], k[2] != "step", k[2]))
    print("method".ljust(14) + "M".rjust(4) + "  layer".ljust(10) + "".join(lb.rjust(16) for lb in labels))
    for key in keys:
        base = data[0].get(key)
        cells = []
        for d in data:
            v = d.get(key)
            cells.append("-" if v is None else f"{v:.1f}" + (f" ({v / base:.3f})" if base and d is not data[0] else ""))
        print(key[0].ljust(14) + str(key[1]).rjust(4) + "  " + key[2].ljust(8) + "".join(c.rjust(16) for c in cells))


if __name__ == "__main__":
    main(sys.argv[1:])
