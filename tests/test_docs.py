"""The docs quote their result files: the decode-step tables of README.md and docs/PERFORMANCE.md
are bench_decode_h100.json's figures, and prose carries no commit hashes or dates (the result
files record them)."""
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/PERFORMANCE.md", "CONTRIBUTING.md", "docs/DESIGN.md", "docs/FORMAT.md")


def standing_decode() -> dict[str, dict[int, int]]:
    data = json.loads((ROOT / "benchmarks" / "results" / "bench_decode_h100.json").read_text())
    rows: dict[str, dict[int, int]] = {}
    for r in data["results"]:
        rows.setdefault(r["method"], {})[r["m"]] = round(r["us"])
    return rows


def table_after(text: str, marker: str) -> list[list[str]]:
    """The rows of the first markdown table after `marker`."""
    rest = text[text.index(marker):]
    lines = rest[rest.index("\n|"):].strip().splitlines()
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if not set("".join(cells)) <= set("- "):
            rows.append(cells)
    return rows


@pytest.mark.parametrize("doc, marker, name", [
    ("README.md", "`bench_decode_h100.json`:", lambda bits: f"kbit K={bits}"),
    ("docs/PERFORMANCE.md", "`bench_decode_h100.json`. The README quotes this table.", lambda bits: f"kbit{bits}"),
])
def test_decode_tables_quote_the_standing_result_file(doc, marker, name):
    rows = {r[0]: r for r in table_after((ROOT / doc).read_text(), marker)}
    header = next(iter(rows.values()))
    standing = standing_decode()
    for bits in (2, 3, 4, 5):
        row = rows[name(bits)]
        for m, us in standing[f"kbit{bits}"].items():
            assert row[header.index(f"M={m}")] == str(us), (doc, bits, m)


@pytest.mark.parametrize("doc", DOCS)
def test_no_commit_hashes_or_dates_in_prose(doc):
    text = (ROOT / doc).read_text()
    prose = re.sub(r"`[^`]*`", "", text)  # file names and commands may carry them
    assert not re.findall(r"\b20\d\d-\d\d-\d\d\b", prose), doc
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", prose) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert not hashes, (doc, hashes)


def _close(cell: str, value: float) -> bool:
    """A table cell quotes `value`: its first number within the rounding the table uses."""
    shown = float(re.match(r"[-+0-9.e]+", cell).group(0))
    return abs(shown - value) <= max(5e-3 * abs(value), 6e-4)


def test_strict_quality_table_quotes_its_result_file():
    """Every 'kbit METHOD K=k[, rotated]' and 'kbit METHOD mixed A' row of the stricter-measure
    table is the stored entry's perplexity, KL and top-1 on both texts."""
    res = json.loads((ROOT / "benchmarks" / "results" / "quality_smollm2.json").read_text())["strict"]["results"]
    rows = table_after((ROOT / "docs" / "PERFORMANCE.md").read_text(), "### Stricter measure")
    checked = 0
    for row in rows:
        m = re.fullmatch(r"kbit (\w+) K=(\d)(, rotated)?", row[0])
        mix = re.match(r"kbit (\w+) mixed ([\d.]+)(, gptq loss)?", row[0])
        if m:
            entry = res[f"kbit-{m[1]}{'-rot' if m[3] else ''} K{m[2]}"]
        elif mix:
            entry = res[f"kbit-{mix[1]} mixed {mix[2]}{' gptq-loss' if mix[3] else ''}"]
        else:
            continue
        for cells, text in ((row[2:5], "handbook"), (row[5:8], "pydocs")):
            for cell, key in zip(cells, ("ppl", "kl", "top1")):
                assert _close(cell, entry[text][key]), (row[0], text, key, cell, entry[text][key])
        checked += 1
    assert checked >= 12


def test_minilm_cosine_table_quotes_its_result_file():
    res = json.loads((ROOT / "benchmarks" / "results" / "quality_minilm.json").read_text())["cosine"]["results"]
    rows = table_after((ROOT / "docs" / "PERFORMANCE.md").read_text(), "### MiniLM: sentence embeddings")
    for row in rows[1:]:
        entry = res[row[0].split(" (")[0]]
        for cell, (text, key) in zip(row[2:6], [(t, k) for t in ("handbook", "pydocs") for k in ("mean_cos", "min_cos")]):
            assert _close(cell, entry[text][key]), (row[0], text, key, cell)
    assert len(rows) >= 10
