"""The record every Megatron-Core patch of this package is: what it fixes, how, and the
probe that says whether unpatched Megatron still breaks there."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Patch:
    """One CPU patch of Megatron-Core (or of torch.cuda as Megatron uses it)."""

    name: str
    reason: str
    apply: Callable[[], None]
    still_needed: Callable[[], bool]
    """True while unpatched Megatron/torch still breaks at this point on CPU."""


def rebind(source_module: str, name: str, replacement, users) -> None:
    """Replace `name` in the module that defines it and in every module that imported it
    by name: patching only an importer leaves the original reachable from the source."""
    original = getattr(importlib.import_module(source_module), name)
    for module_name in (source_module, *users):
        module = importlib.import_module(module_name)
        if getattr(module, name) is original:
            setattr(module, name, replacement)
