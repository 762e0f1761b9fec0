"""The gamma ramps as the training loop sees them: advanced once per step (the layers hold
the ramps and are found by protocol, views.protocols.GammaRamped: any variant whose record
has a gamma ramp)."""

from __future__ import annotations

from typing import Callable, Optional

from megatron_mvmoe.training.build import Trainer
from megatron_mvmoe.views.protocols import gamma_ramped


def gamma_advance(trainer: Trainer) -> Callable[[], Optional[float]]:
    """advance(): every gamma ramp of the trainer's chunks one step on; returns the new
    gamma (the loop logs and checkpoints it), None without such layers. The layers are
    found once (a protocol check per module is not free at every step)."""
    layers = [m for c in trainer.unwrapped() for m in gamma_ramped(c)]

    def advance() -> Optional[float]:
        values = [layer.advance_gamma() for layer in layers]
        return values[0] if values else None

    return advance
