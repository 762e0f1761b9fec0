"""User-facing configuration errors of the layer adapters."""

from __future__ import annotations


def require(ok: bool, field_name: str, problem: str, fix: str) -> None:
    """Raise a ValueError that names the field, what is wrong and how to fix it."""
    if not ok:
        raise ValueError(f"{field_name}: {problem}. Fix: {fix}")
