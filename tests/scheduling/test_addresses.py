"""Where roles bind and what they advertise: loopback on one box, the node's address across nodes,
and no literal loopback anywhere in the code that other processes dial."""

import ast
from pathlib import Path

import pytest

import asyncwebrl
from asyncwebrl.net import LOOPBACK, NODE, advertised_address, bind_address, node_address

PKG = Path(asyncwebrl.__file__).parent
# the HTML report server (`asyncwebrl view --serve`) is for the user's own browser on this machine;
# the browser's network fence runs its proxy gates in the browser's own process
SINGLE_MACHINE_BY_DESIGN = {"net.py", "view/report.py", "web/fence.py", "web/browser.py"}


def test_one_box_binds_and_advertises_loopback():
    assert node_address(False) == LOOPBACK
    assert bind_address(NODE, False) == LOOPBACK
    assert advertised_address("0.0.0.0", False) == LOOPBACK
    assert bind_address("10.1.2.3", True) == "10.1.2.3"  # a literal address is kept


def test_node_address_across_nodes_needs_ray():
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray session is open in this process")
    with pytest.raises(RuntimeError, match="needs Ray"):
        node_address(True)


def _string_constants(tree: ast.AST):
    # bare string statements are documentation (module, class, function and field docstrings)
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            yield node


def test_no_literal_loopback_outside_net_module():
    offenders = []
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        if rel in SINGLE_MACHINE_BY_DESIGN or rel.startswith("bench/"):
            continue
        for node in _string_constants(ast.parse(path.read_text())):
            if "127.0.0.1" in node.value:
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, f"literal loopback addresses (use asyncwebrl.net): {offenders}"
