"""The Multi-View gamma ramps as the training loop sees them: advance once per step, read
the current value for the log (models/layers hold the ramps: layers/multi_view_moe.py)."""

from __future__ import annotations

from typing import Callable, Optional, Tuple

from megatron_mvmoe.layers.multi_view_moe import MultiViewMoELayer, advance_gamma_ramps
from megatron_mvmoe.training.build import Trainer


def gamma_controls(trainer: Trainer) -> Tuple[Callable[[], Optional[float]],
                                               Callable[[], Optional[float]]]:
    """(advance, current) for the Multi-View gamma ramps; both return None without such
    layers."""
    layers = [m for c in trainer.unwrapped() for m in c.modules()
              if isinstance(m, MultiViewMoELayer)]

    def advance() -> Optional[float]:
        values = [advance_gamma_ramps(c) for c in trainer.unwrapped()]
        return next((v for v in values if v is not None), None)

    def current() -> Optional[float]:
        return float(layers[0].gamma()) if layers else None

    return advance, current
