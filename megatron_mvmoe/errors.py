"""The one user-facing error helper: a ValueError that names the field, what is wrong and
how to fix it (configs, layouts, data). Internal invariants use `assert` instead."""

from __future__ import annotations


def require(ok: bool, field_name: str, problem: str, fix: str) -> None:
    """Raise `ValueError("<field>: <problem>. Fix: <fix>")` unless `ok`."""
    if not ok:
        raise ValueError(f"{field_name}: {problem}. Fix: {fix}")
