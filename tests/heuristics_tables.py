"""The per-GPU tables of csrc/dispatch/heuristics.h, read from the header: tests that replay a
planner against measurements take the tuned numbers from here, not from copies."""
import os
import re

HEADER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "dispatch", "heuristics.h")


def _fields(text):
    body = text[text.index("struct Heuristics {"):]
    body = body[:body.index("};")]
    return [(name, int(count) if count else None)
            for name, count in re.findall(r"^\s+(?:const char\*|int|double)\s+(\w+)(?:\[(\d+)\])?;", body, re.M)]


def tables():
    """{table name: {field: value (a list for the per-bit-width fields)}}"""
    text = open(HEADER).read()
    fields = _fields(text)
    out = {}
    for init in re.findall(r"constexpr Heuristics k\w+Heuristics = \{(.*?)\};", text, re.S):
        tokens = re.findall(r'"[^"]*"|\{[^}]*\}|[-\d.]+', init)
        assert len(tokens) == len(fields), (tokens, fields)
        row = {}
        for (name, count), tok in zip(fields, tokens):
            if tok.startswith('"'):
                row[name] = tok.strip('"')
            elif tok.startswith("{"):
                row[name] = [float(v) if "." in v else int(v) for v in tok.strip("{}").split(",")]
                assert len(row[name]) == count, name
            else:
                row[name] = float(tok) if "." in tok else int(tok)
        out[row["name"]] = row
    return out


def table(name):
    return tables()[name]
