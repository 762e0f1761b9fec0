"""The package-level import graph has no circle: collapse every module import (function-level
ones included, read by tests/import_walker.py) to the packages of megatron_mvmoe
(`megatron_mvmoe.<package>`, top-level modules such as errors.py count as packages) and
find the strongly connected components. A cycle such as layers -> views -> layers (views
once took BitNet's math from layers/bitnet.py instead of functional/quantize.py) fails
here, naming the packages and one import edge each way."""

from typing import Dict, List, Set, Tuple

from import_walker import graph


def package_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "mvmoe_kernels":
        return "mvmoe_kernels"
    return ".".join(parts[:2]) if parts[0] == "megatron_mvmoe" and len(parts) > 1 else ""


def package_graph(modules: Dict[str, Set[str]]) -> Dict[str, Dict[str, Tuple[str, str]]]:
    """package -> {package it imports: (one importing module, the module imported)}."""
    edges: Dict[str, Dict[str, Tuple[str, str]]] = {}
    for module, imported in sorted(modules.items()):
        source = package_of(module)
        for target_module in sorted(imported):
            target = package_of(target_module)
            if source and target and target != source:
                edges.setdefault(source, {}).setdefault(target, (module, target_module))
    return edges


def cycles(edges: Dict[str, Dict[str, Tuple[str, str]]]) -> List[List[str]]:
    """The strongly connected components of more than one package (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in edges.get(node, {}):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_packages():
    edges = package_graph(graph())
    problems = []
    for component in cycles(edges):
        witness = [f"{a} -> {b} ({edges[a][b][0]} imports {edges[a][b][1]})"
                   for a in component for b in component if b in edges.get(a, {})]
        problems.append(" | ".join(witness))
    assert not problems, "import cycles between packages: " + "; ".join(problems)


def test_a_cycle_is_caught():
    """The detector against a naive reference: a planted two-package circle and a
    three-package one are found, a chain is not."""
    fake = {"megatron_mvmoe.a.x": {"megatron_mvmoe.b.y"},
            "megatron_mvmoe.b.y": {"megatron_mvmoe.a.z"},
            "megatron_mvmoe.c.x": {"megatron_mvmoe.d.x"},
            "megatron_mvmoe.d.x": {"megatron_mvmoe.e.x"},
            "megatron_mvmoe.e.x": {"megatron_mvmoe.c.y"},
            "megatron_mvmoe.f.x": {"megatron_mvmoe.a.x"}}
    assert sorted(cycles(package_graph(fake))) == [
        ["megatron_mvmoe.a", "megatron_mvmoe.b"],
        ["megatron_mvmoe.c", "megatron_mvmoe.d", "megatron_mvmoe.e"]]
