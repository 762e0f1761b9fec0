"""Warm start a Multi-View (or Multi-Router) model from a baseline latent-MoE state dict.

Mapping, per MoE layer (keys are matched by name, the rest must match shape for shape):
- `router.weight` [E, D] -> head 0 of the Multi-Router weight [R*E, D] (rows 0..E-1); the
  other heads keep their own fresh, independent initialisation;
- `router.expert_bias` -> copied (selection balance carries over);
- `fc1_latent_proj.weight` (P) -> the backbone view (same key in MultiViewProjection);
- `fc1_latent_proj.view_perturbations` (dP_m) keep their initialisation (view_init_std);
- the gamma ramp restarts at step 0, so at the first step every view equals P h.

What is exact: with gamma = 0 the views are inert, so the warm-started Multi-View model's
first forward equals a Multi-Router model holding the same weights bit for bit, and with
R = K = 1 it equals the baseline bit for bit. With R > 1 the new heads join the summed
score (Eq. 2-3), so selection and gates follow the new router from the first step; a
fresh head cannot be inert under Eq. 3 (a zero head adds 0.5 to every score, which keeps
the selection but changes the gates).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch

_KEEP_TARGET_SUFFIXES = ("view_perturbations", "gamma_ramp_state", "_extra_state")


@dataclass
class WarmStartReport:
    copied: List[str] = field(default_factory=list)
    """Keys copied unchanged from the baseline."""
    router_head0: List[str] = field(default_factory=list)
    """Router weights whose head 0 came from the baseline (other heads fresh)."""
    kept: List[str] = field(default_factory=list)
    """Target-only keys kept at their initialisation (view perturbations, gamma state)."""


def warm_start_state_dict(baseline: Dict[str, torch.Tensor],
                          target: Dict[str, torch.Tensor]) -> (Dict, WarmStartReport):
    """The target's state dict with the baseline's weights mapped in (new dict)."""
    merged, report = dict(target), WarmStartReport()
    unused = set(k for k in baseline if not k.endswith("_extra_state"))
    for key, value in target.items():
        if key not in baseline:
            _require_target_only(key)
            report.kept.append(key)
            continue
        unused.discard(key)
        source = baseline[key]
        if not torch.is_tensor(value) or source.shape == value.shape:
            merged[key] = source.clone() if torch.is_tensor(source) else source
            report.copied.append(key)
        elif key.endswith("router.weight") and _is_head0_of(source, value):
            merged[key] = torch.cat([source.to(value.dtype), value[source.shape[0]:]], 0)
            report.router_head0.append(key)
        else:
            raise ValueError(f"{key}: baseline shape {tuple(source.shape)} does not fit "
                             f"{tuple(value.shape)}. Fix: use the same hidden, latent and "
                             "expert sizes as the baseline")
    if unused:
        raise ValueError(f"baseline keys with no place in the target: {sorted(unused)[:5]}. "
                         "Fix: warm start from a latent-MoE baseline of the same architecture")
    return merged, report


def warm_start_multi_view(model: torch.nn.Module,
                          baseline: Dict[str, torch.Tensor]) -> WarmStartReport:
    """Load `baseline` into `model` in place and restart every gamma ramp at step 0."""
    from megatron_mvmoe.layers.multi_view_moe import MultiViewMoELayer

    merged, report = warm_start_state_dict(baseline, model.state_dict())
    model.load_state_dict(merged)
    for module in model.modules():
        if isinstance(module, MultiViewMoELayer):
            module.restart_gamma()
    return report


def _is_head0_of(source: torch.Tensor, value: torch.Tensor) -> bool:
    rows, width = source.shape
    return value.shape[1] == width and value.shape[0] % rows == 0 and value.shape[0] > rows


def _require_target_only(key: str) -> None:
    if not key.endswith(_KEEP_TARGET_SUFFIXES):
        raise ValueError(f"{key}: missing from the baseline checkpoint. Fix: warm start from "
                         "a latent-MoE baseline (moe_variant='latent') of the same architecture")
