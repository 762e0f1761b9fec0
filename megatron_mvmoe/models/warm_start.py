"""Warm start a Multi-View (or Multi-Router) model from a baseline latent-MoE state dict.

Mapping, per MoE layer (keys are matched by name, the rest must match shape for shape):
- `router.weight` [E, D] -> head 0 of the Multi-Router weight [R*E, D] (rows 0..E-1); heads
  1..R-1 by `new_heads`:
    "fresh" (default, the paper): they keep their own independent initialisation;
    "copy": they are copies of head 0 and `router.expert_bias` is multiplied by R;
- `router.expert_bias` -> copied ("fresh") or copied x R ("copy");
- `fc1_latent_proj.weight` (P) -> the backbone view (same key in MultiViewProjection);
- `fc1_latent_proj.view_perturbations` (dP_m) keep their initialisation (view_init_std);
- the gamma ramp restarts at step 0, so at the first step every view equals P h.

What is exact: with gamma = 0 the views are inert, so the warm-started Multi-View model's
first forward equals a Multi-Router model holding the same weights bit for bit, and with
R = K = 1 it equals the baseline.
- "fresh", R > 1: the new heads join the summed score (Eq. 2-3), so selection and gates
  follow the new router from the first step (a fresh head cannot be inert under Eq. 3: a
  zero head adds 0.5 to every score, which keeps the selection but changes the gates).
- "copy": the summed score is R s, selection runs on R s + R b = R (s + b) (the baseline's
  order), the normalised gates R s_i / sum R s_j are the baseline's (k = 1: R s_i / R),
  every mixing weight is 1/R and every view is P h, so the first forward is the baseline's:
  bit for bit for R = 2 (scaling by 2 is exact), within rounding for other R. The heads
  then diverge only through the views (each a_{m,i} weighs a different view once
  gamma > 0). Without views nothing tells identical heads apart (their gradients are
  identical forever), so "copy" is refused for Multi-Router models.
  The expert bias lives in R-times-larger units afterwards, so Megatron's fixed bias update
  rate moves selection R times more slowly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch

from megatron_mvmoe.config.run_config import WARM_START_NEW_HEADS
from megatron_mvmoe.views.protocols import restart_gamma_ramps

NEW_HEADS = WARM_START_NEW_HEADS
_KEEP_TARGET_SUFFIXES = ("view_perturbations", "gamma_ramp_state", "gate_scale",
                         "_extra_state")
_VIEWS_KEY = "fc1_latent_proj.view_perturbations"


@dataclass
class WarmStartReport:
    copied: List[str] = field(default_factory=list)
    """Keys copied unchanged from the baseline."""
    router_head0: List[str] = field(default_factory=list)
    """Router weights whose head 0 came from the baseline (other heads by `new_heads`)."""
    kept: List[str] = field(default_factory=list)
    """Target-only keys kept at their initialisation (view perturbations, gamma state)."""
    scaled_bias: List[str] = field(default_factory=list)
    """Expert biases multiplied by R ("copy" only)."""


def warm_start_state_dict(baseline: Dict[str, torch.Tensor], target: Dict[str, torch.Tensor],
                          new_heads: str = "fresh") -> (Dict, WarmStartReport):
    """The target's state dict with the baseline's weights mapped in (new dict).

    Args:
        baseline: a latent-MoE state dict (moe_variant='latent' or R = 1).
        target: the Multi-View / Multi-Router model's own state dict (shapes and fresh init).
        new_heads: "fresh" (heads 1..R-1 keep the target's init) or "copy" (see module doc).
    """
    if new_heads not in NEW_HEADS:
        raise ValueError(f"new_heads: unknown {new_heads!r}. Fix: use one of {NEW_HEADS}")
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
            merged[key] = _router_heads(source.to(value.dtype), value, new_heads)
            report.router_head0.append(key)
        else:
            raise ValueError(f"{key}: baseline shape {tuple(source.shape)} does not fit "
                             f"{tuple(value.shape)}. Fix: use the same hidden, latent and "
                             "expert sizes as the baseline")
    if unused:
        raise ValueError(f"baseline keys with no place in the target: {sorted(unused)[:5]}. "
                         "Fix: warm start from a latent-MoE baseline of the same architecture")
    if new_heads == "copy":
        _scale_copied_biases(merged, baseline, target, report)
    return merged, report


def warm_start_multi_view(model: torch.nn.Module, baseline: Dict[str, torch.Tensor],
                          new_heads: str = "fresh") -> WarmStartReport:
    """Load `baseline` into `model` in place and restart every gamma ramp at step 0."""
    merged, report = warm_start_state_dict(baseline, model.state_dict(), new_heads)
    model.load_state_dict(merged)
    restart_gamma_ramps(model)
    return report


def _router_heads(source_ED: torch.Tensor, value_XD: torch.Tensor, new_heads: str):
    """[R*E, D]: head 0 from the baseline; the rest fresh (value's) or copies of head 0."""
    if new_heads == "copy":
        return source_ED.repeat(value_XD.shape[0] // source_ED.shape[0], 1)
    return torch.cat([source_ED, value_XD[source_ED.shape[0]:]], 0)


def _scale_copied_biases(merged, baseline, target, report: WarmStartReport) -> None:
    """"copy": every router with R > 1 copied heads gets expert_bias x R; refuse layers that
    have no views to tell the copies apart."""
    for key in report.router_head0:
        prefix = key[:-len("router.weight")]
        num_heads = target[key].shape[0] // baseline[key].shape[0]
        views = target.get(prefix + _VIEWS_KEY)
        if views is None or views.shape[0] == 0:
            raise ValueError(
                f"new_heads: 'copy' at {key}, a Multi-Router layer without views: identical "
                "heads get identical gradients (the summed score is symmetric in the heads), "
                "so the copies would never diverge. Fix: use new_heads='fresh', or "
                "moe_variant='multi_view' (the views tell the heads apart once gamma > 0)")
        bias_key = prefix + "router.expert_bias"
        if bias_key in merged:
            merged[bias_key] = merged[bias_key] * num_heads
            report.scaled_bias.append(bias_key)


def _is_head0_of(source: torch.Tensor, value: torch.Tensor) -> bool:
    rows, width = source.shape
    return value.shape[1] == width and value.shape[0] % rows == 0 and value.shape[0] > rows


def _require_target_only(key: str) -> None:
    if not key.endswith(_KEEP_TARGET_SUFFIXES):
        raise ValueError(f"{key}: missing from the baseline checkpoint. Fix: warm start from "
                         "a latent-MoE baseline (moe_variant='latent') of the same architecture")
