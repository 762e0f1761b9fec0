"""Slurm hostlist and tasks-per-node expansion, in pure Python.

Design choices:
- Pure Python so rendezvous works on nodes where `scontrol` is absent (containers
  launched by srun often lack the Slurm client tools) and so it can be unit-tested.
- Supports the syntax Slurm emits in SLURM_JOB_NODELIST: comma-separated items, each
  with zero or more bracket groups of comma-separated numbers and ranges
  ("node[01-03,07],gpu5", "rack[1-2]-n[1-2]"); zero padding follows the lower bound.
- Errors are ValueErrors that quote the offending text: a malformed nodelist in the
  environment is a launcher mistake the user must see verbatim.
"""

from __future__ import annotations

import itertools
import re
from typing import List

_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> List[str]:
    """Split on commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"hostlist {text!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"hostlist {text!r}: unmatched ']' at position {i}")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"hostlist {text!r}: unclosed '['")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_ranges(body: str, text: str) -> List[str]:
    """'01-03,07' -> ['01', '02', '03', '07'], keeping the lower bound's padding."""
    values = []
    for part in body.split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise ValueError(f"hostlist {text!r}: bad range {part!r} inside brackets")
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        low, high = int(low_text), int(high_text)
        if high < low:
            raise ValueError(f"hostlist {text!r}: range {part!r} runs backwards")
        width = len(low_text)
        values.extend(str(n).zfill(width) for n in range(low, high + 1))
    return values


def _expand_item(item: str, text: str) -> List[str]:
    """Expand one top-level item: literal pieces and bracket groups, cartesian product."""
    pieces = re.split(r"(\[[^\]]*\])", item)
    choices = []
    for piece in pieces:
        if piece.startswith("["):
            choices.append(_expand_ranges(piece[1:-1], text))
        elif piece:
            choices.append([piece])
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_hostlist(text: str) -> List[str]:
    """Expand a Slurm hostlist expression into host names, in order.

    >>> expand_hostlist("node[01-03,07],gpu5")
    ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    if not text or not text.strip():
        raise ValueError("hostlist is empty: expected e.g. 'node[01-04]'")
    hosts: List[str] = []
    for item in _split_top_level(text.strip()):
        hosts.extend(_expand_item(item, text))
    return hosts


def expand_tasks_per_node(text: str) -> List[int]:
    """Expand SLURM_TASKS_PER_NODE syntax: '2(x3),1' -> [2, 2, 2, 1]."""
    counts: List[int] = []
    for item in text.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if not match:
            raise ValueError(
                f"tasks-per-node {text!r}: bad item {item!r}; expected 'N' or 'N(xM)'"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
