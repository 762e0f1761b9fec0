"""The record every Megatron-Core patch of this package is: what it fixes, how, and the
probe that says whether unpatched Megatron still breaks there."""

from __future__ import annotations

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
