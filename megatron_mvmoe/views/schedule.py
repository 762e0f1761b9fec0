"""Gamma ramp for the view perturbations: v_m = P h + gamma(t) dP_m h, gamma 0 -> 1.

Design choices:
- Linear ramp over `ramp_steps` optimizer steps; 0 steps means gamma = 1 from the start.
  At gamma = 0 every view equals the backbone view, so a warm start from a baseline latent-MoE
  checkpoint reproduces the baseline exactly.
- The ramp keeps its own step counter (advanced once per optimizer step by the training
  loop) and checkpoints it with state_dict / load_state_dict, so a resumed run continues the
  ramp where it stopped. A resume with another ramp length keeps the step and takes the
  new length (gamma moves to step / new length; the trainer's resume line names the
  change): the ramp holds no parameters, so the checkpoint's weights fit either way.
"""

from __future__ import annotations

from typing import Optional


class GammaRamp:
    """gamma(step) = min(1, step / ramp_steps); 1 everywhere when ramp_steps == 0."""

    def __init__(self, ramp_steps: int) -> None:
        if ramp_steps < 0:
            raise ValueError(f"multi_view.gamma_ramp_steps: must be >= 0, got {ramp_steps}. "
                             "Fix: use 0 for no ramp")
        self.ramp_steps = int(ramp_steps)
        self.step = 0
        """Optimizer steps taken so far (advance() once per step)."""

    def value(self, step: Optional[int] = None) -> float:
        """gamma at `step` (default: the ramp's own counter)."""
        step = self.step if step is None else step
        if step < 0:
            raise ValueError(f"step: must be >= 0, got {step}")
        if self.ramp_steps == 0:
            return 1.0
        return min(1.0, step / self.ramp_steps)

    def advance(self, num_steps: int = 1) -> float:
        """Count optimizer steps; returns the new gamma."""
        self.step += num_steps
        return self.value()

    def state_dict(self) -> dict:
        return {"ramp_steps": self.ramp_steps, "step": self.step}

    def load_state_dict(self, state: dict) -> None:
        """Restore the step counter; this ramp's length applies from that step (a changed
        length is named by the trainer's resume line, training/checkpoint.py)."""
        self.step = int(state["step"])
