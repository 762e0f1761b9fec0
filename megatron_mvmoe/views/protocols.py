"""What callers ask of a layer with views, by protocol instead of by class, so a new variant's
layer is found by what it does (its record says it has a gamma ramp / mixes views; its
layer implements these methods) and no caller names MultiViewMoELayer.

Legend: T tokens, D hidden, L latent, R views, S selected slots.

- `GammaRamped`: the layer owns a gamma ramp; the trainer advances it once per optimizer
  step, the warm start and upcycling restart it (training/gamma_ramp.py,
  models/warm_start.py, models/upcycling.py).
- `ViewMixing`: a GammaRamped layer whose experts see blends of views: the routing probe
  recomputes its views (`views_of(hidden_TD) -> views_TRL` at the current gamma) and the
  mixing interventions transform its mixing weights (`mix_transforms`: mix_TSR -> mix_TSR).

Members are methods or plain attributes: isinstance on a runtime protocol looks attributes
up statically, so a submodule (held in nn.Module's `_modules`) would never be found.
"""

from __future__ import annotations

from typing import Callable, Iterator, List, Protocol, runtime_checkable

import torch


@runtime_checkable
class GammaRamped(Protocol):
    def gamma(self) -> float:
        """The current gamma."""

    def advance_gamma(self, num_steps: int = 1) -> float:
        """Count optimizer steps; returns the new gamma."""

    def restart_gamma(self) -> None:
        """Back to step 0 (gamma = 0 when ramping)."""


@runtime_checkable
class ViewMixing(GammaRamped, Protocol):
    mix_transforms: List[Callable[[torch.Tensor], torch.Tensor]]

    def views_of(self, hidden_TD: torch.Tensor) -> torch.Tensor:
        """views_TRL at the current gamma."""


def gamma_ramped(model: torch.nn.Module) -> Iterator[GammaRamped]:
    """Every module of `model` that owns a gamma ramp."""
    return (m for m in model.modules() if isinstance(m, GammaRamped))


def restart_gamma_ramps(model: torch.nn.Module) -> None:
    """Every gamma ramp of `model` back to step 0 (the warm start, upcycling)."""
    for module in gamma_ramped(model):
        module.restart_gamma()
