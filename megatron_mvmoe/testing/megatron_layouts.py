"""The rank counts a Megatron test file's parallel layouts need, read from its source.

Design choices:
- Nothing is imported or run: the file is parsed (ast) and its layouts are read from
  what Megatron's tests write literally, the two forms every MoE test uses:
  `@pytest.mark.parametrize("tp_size,ep_size", [(1, 8), (4, 2)])` (also `tp_ep` tuples,
  `pytest.param(...)` rows, class-level marks) and
  `initialize_model_parallel(1, 1, expert_model_parallel_size=8)` (literal ints; a keyword
  set to a parametrized name, e.g. `expert_tensor_parallel_size=ep_size`, gives that name
  the keyword's dimension).
- A layout (tp, pp, cp, ep, etp; etp defaults to tp as in Megatron) needs a world size
  that both its dense group tp*pp*cp and its expert group etp*ep*pp divide: their lcm.
- A file runs at 1 rank (its single-rank tests) and at the smallest count of RANK_STEPS
  that fits each layout; a layout larger than 8 gets its own count. A layout the parser
  cannot read (sizes computed at run time) is not seen: the file then runs at the counts
  of the layouts it can read, at least 1.
"""

from __future__ import annotations

import ast
import itertools
import math
from typing import Dict, Iterator, List, Sequence

RANK_STEPS = (1, 2, 4, 8)
"""The rank counts a file can be run at (Megatron's CI runs these tests on 8 GPUs)."""

# argument / keyword name -> layout dimension
_DIM_OF_NAME = {
    "tp": "tp", "tp_size": "tp", "tensor_model_parallel_size": "tp",
    "pp": "pp", "pp_size": "pp", "pipeline_model_parallel_size": "pp",
    "cp": "cp", "cp_size": "cp", "context_parallel_size": "cp",
    "ep": "ep", "ep_size": "ep", "expert_model_parallel_size": "ep",
    "etp": "etp", "etp_size": "etp", "moe_tp_size": "etp", "expert_tensor_parallel_size": "etp",
}
_INIT_CALLS = ("initialize_model_parallel",)
_POSITIONAL_DIMS = ("tp", "pp")  # initialize_model_parallel(tp, pp, ...)


def world_size_needed(layout: Dict[str, int]) -> int:
    """The smallest world size Megatron accepts for this layout."""
    tp, pp, cp = layout.get("tp", 1), layout.get("pp", 1), layout.get("cp", 1)
    ep, etp = layout.get("ep", 1), layout.get("etp", tp)
    return math.lcm(tp * pp * cp, etp * ep * pp)


def rank_counts(source: str) -> List[int]:
    """The rank counts a test file's layouts need, always including 1."""
    counts = {1}
    for layout in layouts(source):
        need = world_size_needed(layout)
        counts.add(next((n for n in RANK_STEPS if n >= need and n % need == 0), need))
    return sorted(counts)


def layouts(source: str) -> Iterator[Dict[str, int]]:
    """Every layout the file's test functions (and setup methods) spell out."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            class_marks = _parametrizations(node.decorator_list)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield from _function_layouts(item, class_marks)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node in tree.body:
            yield from _function_layouts(node, [])  # a module-level test


def _function_layouts(func, class_marks: List[List[Dict[str, object]]]):
    """The function's parametrized rows (crossed over its marks) merged with its literal
    initialize_model_parallel calls."""
    marks = class_marks + _parametrizations(func.decorator_list)
    dim_of_arg = dict(_DIM_OF_NAME)
    literal_calls = []
    for call in _init_calls(func):
        literal, named = _call_dims(call)
        literal_calls.append(literal)
        dim_of_arg.update({arg: dim for dim, arg in named.items()})
    rows = [_merge(combo) for combo in itertools.product(*marks)] if marks else [{}]
    for row in rows:
        from_marks = {}
        for arg, value in row.items():
            for dim, size in _dims_of_arg(arg, value, dim_of_arg):
                from_marks[dim] = size
        for literal in literal_calls or [{}]:
            layout = {**from_marks, **literal}
            if layout:
                yield layout


def _dims_of_arg(arg: str, value, dim_of_arg: Dict[str, str]):
    """(dim, size) pairs one parametrized argument sets: `tp_size=2`, or `tp_ep=(1, 2)`."""
    if arg in dim_of_arg and isinstance(value, int):
        yield dim_of_arg[arg], value
        return
    parts = arg.split("_")
    if (isinstance(value, tuple) and len(parts) == len(value) > 1
            and all(p in _DIM_OF_NAME for p in parts)):
        for part, size in zip(parts, value):
            if isinstance(size, int):
                yield _DIM_OF_NAME[part], size


def _merge(rows: Sequence[Dict[str, object]]) -> Dict[str, object]:
    merged: Dict[str, object] = {}
    for row in rows:
        merged.update(row)
    return merged


def _init_calls(func) -> Iterator[ast.Call]:
    for node in ast.walk(func):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(
                node.func, "id", "")
            if name in _INIT_CALLS:
                yield node


def _call_dims(call: ast.Call):
    """({dim: literal size}, {dim: parametrized name}) of one initialize_model_parallel call."""
    literal, named = {}, {}
    pairs = list(zip(_POSITIONAL_DIMS, call.args))
    pairs += [(_DIM_OF_NAME[k.arg], k.value) for k in call.keywords if k.arg in _DIM_OF_NAME]
    for dim, value in pairs:
        if isinstance(value, ast.Constant) and isinstance(value.value, int):
            literal[dim] = value.value
        elif isinstance(value, ast.Name):
            named[dim] = value.id
    return literal, named


def _parametrizations(decorators) -> List[List[Dict[str, object]]]:
    """One list of rows ({argname: value}) per `parametrize` decorator."""
    marks = []
    for deco in decorators:
        if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                and deco.func.attr == "parametrize" and len(deco.args) >= 2):
            continue
        names = _literal(deco.args[0])
        if isinstance(names, str):
            names = [n.strip() for n in names.split(",")]
        if not isinstance(names, (list, tuple)) or not isinstance(deco.args[1],
                                                                   (ast.List, ast.Tuple)):
            continue
        rows = []
        for element in deco.args[1].elts:
            values = _row_values(element, len(names))
            if values is not None:
                rows.append(dict(zip(names, values)))
        if rows:
            marks.append(rows)
    return marks


def _row_values(element: ast.expr, width: int):
    if isinstance(element, ast.Call) and getattr(element.func, "attr", "") == "param":
        values = [_literal(arg) for arg in element.args]
    elif width == 1:
        values = [_literal(element)]
    else:
        values = _literal(element)
    if not isinstance(values, (list, tuple)) or len(values) != width:
        return None
    return list(values)


_UNREADABLE = object()  # a value ast.literal_eval cannot read (a name, a call)


def _literal(node: ast.expr):
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _UNREADABLE
