"""Data flows one way (STYLE.md): every import of the package, lazy ones inside functions included,
goes down the layers below, and no set of modules imports itself round in a circle.

The layers, bottom first. A module may import its own package and any package of a lower layer;
packages that share a layer are siblings and never import each other (rollout and training meet only
through the records of the bottom floor), except on the bottom floor itself, whose modules are small
and may build on one another (the circle check still holds there).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import asyncwebrl

ROOT = Path(asyncwebrl.__file__).parent

LAYERS: list[set[str]] = [
    {"protocol", "net", "httpguard", "configtree", "allocation", "records", "results", "server_http", "loop_thread"},
    {"models", "pixelstore", "weights"},
    {"web", "inference"},
    {"rollout", "training"},
    {"scheduling"},
    {"evaluation"},
    {"config"},
    {"controller"},
    {"view", "bench"},
    {"cli"},
    {"__main__"},
]
FLOOR = 0


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(module imported, line) for every import statement of the file, at any depth."""
    found = []
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        found += [(t, node.lineno) for t in targets if t in known and t != name]
    return found


def _layer_of(module: str) -> tuple[str, int]:
    top = module.split(".")[1] if "." in module else ""
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return top, i
    raise AssertionError(f"{module}: package '{top}' is in no layer of {__file__}; place it there")


def import_graph() -> dict[str, list[tuple[str, int]]]:
    mods = _modules()
    return {m: _imports(m, p, set(mods)) for m, p in mods.items()}


def test_every_import_goes_down_the_layers():
    wrong = []
    for mod, targets in import_graph().items():
        if mod == "asyncwebrl":
            continue
        top, layer = _layer_of(mod)
        for target, line in targets:
            if target == "asyncwebrl":
                continue
            ttop, tlayer = _layer_of(target)
            if ttop == top or tlayer < layer or (tlayer == layer == FLOOR):
                continue
            how = "a sibling" if tlayer == layer else "a layer above"
            wrong.append(f"{mod} (line {line}) imports {target}: {how}")
    assert not wrong, "imports against the data flow:\n" + "\n".join(sorted(wrong))


def _cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycle_even_through_lazy_imports():
    graph = {m: sorted({t for t, _ in ts}) for m, ts in import_graph().items()}
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other round in a circle:\n" + "\n".join(map(str, cycles))


@pytest.mark.parametrize("graph, expected", [
    ({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}, [["a", "b", "c"]]),
    ({"a": ["b"], "b": [], "c": ["b"]}, []),
])
def test_the_cycle_finder_finds_a_circle_and_nothing_else(graph, expected):
    assert _cycles(graph) == expected


def test_a_backwards_import_is_caught(tmp_path):
    """The checker reads lazy imports too: a function-level import of a higher layer is reported."""
    mods = {"asyncwebrl.training.x": tmp_path / "x.py"}
    mods["asyncwebrl.training.x"].write_text("def f():\n    from asyncwebrl.rollout.episode import run_episode\n")
    found = _imports("asyncwebrl.training.x", mods["asyncwebrl.training.x"], {"asyncwebrl.rollout.episode"})
    assert found == [("asyncwebrl.rollout.episode", 2)]
    assert _layer_of("asyncwebrl.rollout.episode")[1] == _layer_of("asyncwebrl.training.x")[1]  # siblings
