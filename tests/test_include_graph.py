"""The include graph of csrc/ points downward: kernels <- launch <- dispatch <- binding. No file
includes itself through others (no circle), and no kernel header or kernel instantiation reaches
a planner (csrc/dispatch/), so a planner edit recompiles no kernel. CPU only."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")


def include_graph():
    """{path under csrc: [paths under csrc it includes]}"""
    graph = {}
    for folder, _, names in os.walk(CSRC):
        for name in names:
            if name.endswith((".h", ".cuh", ".cu", ".cpp")):
                path = os.path.relpath(os.path.join(folder, name), CSRC)
                text = open(os.path.join(folder, name)).read()
                graph[path] = [inc for inc in re.findall(r'^#include "([^"]+)"', text, re.M)
                               if os.path.exists(os.path.join(CSRC, inc))]
    return graph


def reach(graph, start):
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_circle():
    graph = include_graph()
    assert graph
    for path in graph:
        assert path not in reach(graph, path), path


def test_kernels_include_no_planner():
    graph = include_graph()
    kernels = [p for p in graph if p.endswith(".cuh") and not p.startswith(("core/", "dispatch/"))]
    kernels += [p for p in graph if "/instantiations/" in p]
    assert any(p.startswith("wgmma/") for p in kernels) and any("/instantiations/" in p for p in kernels)
    for path in kernels:
        above = sorted(p for p in reach(graph, path) if p.startswith("dispatch/"))
        assert not above, f"{path} includes {above}"
