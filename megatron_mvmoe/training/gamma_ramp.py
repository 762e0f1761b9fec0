"""The Multi-View gamma ramps as the training loop sees them: advanced once per step
(models/layers hold the ramps: layers/multi_view_moe.py)."""

from __future__ import annotations

from typing import Callable, Optional

from megatron_mvmoe.layers.multi_view_moe import advance_gamma_ramps
from megatron_mvmoe.training.build import Trainer


def gamma_advance(trainer: Trainer) -> Callable[[], Optional[float]]:
    """advance(): every gamma ramp of the trainer's chunks one step on; returns the new
    gamma (the loop logs and checkpoints it), None without such layers."""

    def advance() -> Optional[float]:
        values = [advance_gamma_ramps(c) for c in trainer.unwrapped()]
        return next((v for v in values if v is not None), None)

    return advance
