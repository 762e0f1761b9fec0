"""The model fingerprint: every field that changes a parameter's shape or meaning, stored in
run_state.json at save and compared before any tensor is read, so loading into another
model fails naming the differing fields instead of deep inside dist-checkpointing.

Design choices:
- ONE function, `model_fingerprint(model)`, computes it (the trainer's save and resume,
  the tools' `load_weights`) from the resolved model section.
- Fields that do not touch parameters (the gamma ramp, the sequence length) are left out,
  so a checkpoint loads with another ramp or context length.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Dict

from megatron_mvmoe.checkpointing.errors import CheckpointError
from megatron_mvmoe.config.model_section import ModelSection
from megatron_mvmoe.config.transformer_config import MultiHeadConfig

if TYPE_CHECKING:
    from megatron_mvmoe.config.run_config import RunConfig

_NOT_STRUCTURAL = ("preset", "seq_length", "multi_view", "multi_head", "bitnet", "extra")
"""ModelSection fields not in the fingerprint as they are (the nested ones enter flat)."""


def model_fingerprint(model: ModelSection) -> Dict:
    """Every model field that changes a parameter's shape or meaning, in the flat form
    checkpoints have recorded since the first version (so all of them still match):
    shape fields, R, K, H and `extra`; switches added later are recorded only when they
    differ from the default (learned alpha adds parameters, BitNet changes what weights
    mean, MH-MoE's projection switches change which weights exist)."""
    fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
              if f.name not in _NOT_STRUCTURAL}
    views, heads = model.multi_view, model.multi_head
    fields.update(num_routers=views.num_routers, num_views=views.num_views,
                  num_heads_mh=heads.num_heads, extra=dict(model.extra))
    if views.learned_gate_scale:
        fields["learned_gate_scale"] = True
    if model.bitnet.enabled:
        fields["bitnet"] = True
    if dataclasses.replace(heads, num_heads=1) != MultiHeadConfig():
        fields["multi_head"] = dataclasses.asdict(heads)
    return fields


def run_fingerprint(run: "RunConfig") -> Dict:
    """The fingerprint of a run's model."""
    return model_fingerprint(run.model)


ADDED_LATER = {"rotary_base": 10000}
"""Fingerprint fields newer than the first checkpoints -> the value every model had before
they were recorded (a checkpoint without the field was built with it)."""


def check_fingerprint(saved: Dict, current: Dict, directory: str) -> None:
    """CheckpointError naming every differing field (see ADDED_LATER for missing ones)."""
    saved = {**ADDED_LATER, **saved}
    keys = sorted(set(saved) | set(current))
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs this run {current.get(k)!r}"
             for k in keys if saved.get(k) != current.get(k)]
    if diffs:
        raise CheckpointError(f"{directory} is from an incompatible model; differing fields: "
                              + "; ".join(diffs) + ". Fix: use the checkpoint's model config "
                              "(its run_state.json 'config') or start without --load")
