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
