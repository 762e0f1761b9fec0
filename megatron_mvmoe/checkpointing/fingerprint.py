"""The model fingerprint: every field that changes a parameter's shape or meaning, stored in
run_state.json at save and compared before any tensor is read, so loading into another
model fails naming the differing fields instead of deep inside dist-checkpointing.

Design choices:
- ONE function, `model_fingerprint(shape, model)`, computes it (the trainer's save and
  resume, the tools' `load_weights`); when the ModelShape or model section change, only it
  changes.
- Fields that do not touch parameters (the gamma ramp, the sequence length) are left out,
  so a checkpoint loads with another ramp or context length.
"""

from __future__ import annotations

import dataclasses
from typing import Dict

from megatron_mvmoe.checkpointing.errors import CheckpointError
from megatron_mvmoe.models.presets import ModelShape, resolve_model

_NOT_STRUCTURAL = ("gamma_ramp_steps", "seq_length")


def model_fingerprint(shape: ModelShape, model) -> Dict:
    """The fingerprint of a resolved `shape` built with the run's model section `model`."""
    fields = {k: v for k, v in dataclasses.asdict(shape).items() if k not in _NOT_STRUCTURAL}
    # Switches that add parameters (learned alpha) or change what weights mean (BitNet);
    # recorded only when on, so checkpoints written before these switches still match.
    for name in ("learned_gate_scale", "bitnet"):
        if getattr(model, name, None):
            fields[name] = True
    return fields


def run_fingerprint(run: "RunConfig") -> Dict:
    """The fingerprint of a run's model (`run` duck-typed: only `run.model` is read; the
    RunConfig lives in training/, which this package must not import)."""
    return model_fingerprint(resolve_model(run.model), run.model)


def check_fingerprint(saved: Dict, current: Dict, directory: str) -> None:
    keys = sorted(set(saved) | set(current))
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs this run {current.get(k)!r}"
             for k in keys if saved.get(k) != current.get(k)]
    if diffs:
        raise CheckpointError(f"{directory} is from an incompatible model; differing fields: "
                              + "; ".join(diffs) + ". Fix: use the checkpoint's model config "
                              "(its run_state.json 'config') or start without --load")
