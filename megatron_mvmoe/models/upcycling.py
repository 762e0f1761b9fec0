"""Upcycling (`--moe-use-upcycling`): a dense model's weights initialise an MoE model.

Legend: D hidden, L latent, F expert width (= the dense FFN width at granularity 1),
E experts, G granularity (dense FFN width / expert width).

Two mappings, chosen by the target's variant (`upcycle_chunk`):
- stock (smoe): Megatron-Core's own `upcycling_utils.upcycle_state_dict` (every expert a copy
  of the dense MLP, or at G > 1 a G-th slice with Megatron's activation-scale rule of
  arXiv 2410.07524; the router keeps its init). At G = 1 each token's output is
  sum_i g_i MLP(h) with gates normalised over the top-k (sum 1), so the first forward is the
  dense model's; at G > 1 it is Megatron's approximation (SwiGLU is not homogeneous).
- latent / multi_router / multi_view, L >= D, G = 1 (ours; Megatron has no latent path):
  P = [I_D; 0] (L x D), up-projection [I_D, 0] (D x L), each expert's fc1 = [W1, 0]
  (2F x L), fc2 = [W2; 0] (L x F). The experts then see z = [h; 0] and give back
  [MLP(h); 0], the up-projection returns MLP(h): the same identity as the stock path, with
  gates that sum to 1 (sigmoid scores normalised over the selection; Multi-Router's gates
  are normalised over the selected set and scaled by alpha = 1). Routers (every head is a
  new head: "fresh" keeps each head's init, "copy" makes heads 1..R-1 copies of head 0,
  refused without views as in the warm start), expert biases and the Multi-View
  perturbations dP_m keep their init: at gamma = 0 every view is P h, so the views are
  neutral.
Refused, with the reason: L < D (a rank-L bottleneck P cannot pass an arbitrary D-wide
input through unchanged, so no latent layer equals the dense MLP), G > 1 for latent models
(Megatron's fine-grained rule is approximate), MH-MoE (its experts see D/H-wide sub-tokens,
so no expert holds the dense MLP, which mixes all D inputs), alpha != 1, shared experts
(they would add their init to the dense output; upcycle without them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

import torch

from megatron_mvmoe.config.variants import get_variant
from megatron_mvmoe.views.protocols import restart_gamma_ramps

_FC1, _FC2 = "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"
_EXPERT = "mlp.experts.local_experts."
# MoE-only keys that keep the target's initialisation (routers, biases, views, gamma).
_KEEP_SUFFIXES = ("router.weight", "router.expert_bias", "router.local_tokens_per_expert",
                  "view_perturbations", "gamma_ramp_state", "gate_scale", "_extra_state")


@dataclass
class UpcycleReport:
    mapping: str
    """"megatron" (Megatron-Core's upcycle_state_dict) or "latent" (zero-padded identity)."""
    copied: List[str] = field(default_factory=list)
    experts: List[str] = field(default_factory=list)
    """Expert weights made from the dense MLP."""
    projections: List[str] = field(default_factory=list)
    kept: List[str] = field(default_factory=list)
    """Target-only keys kept at their initialisation (routers, biases, views)."""


def upcycle_problems(dense, target, new_heads: str = "fresh") -> List[str]:
    """Why `dense` (a dense ModelSection) cannot be upcycled into `target` (one line each)."""
    problems = []
    variant = target.variant
    if new_heads == "copy" and variant.multi_router and not variant.multi_view:
        problems.append("warm_start_new_heads: 'copy' gives a Multi-Router layer without views "
                        "R identical heads, whose gradients stay identical forever; use "
                        "'fresh', or moe_variant multi_view (its views tell the heads apart)")
    if variant.multi_head:
        problems.append("moe_variant: mh_moe experts see D/H-wide sub-tokens, so no expert can "
                        "hold the dense MLP (which mixes all D inputs); upcycle into smoe, "
                        "latent, multi_router or multi_view")
    elif not target.is_moe:
        problems.append("moe_variant: the target is dense; upcycling makes an MoE model")
    if dense.is_moe:
        problems.append(f"checkpoint moe_variant {dense.moe_variant!r}: upcycling starts from "
                        "a dense model (moe_variant 'dense'); for latent -> multi_view use "
                        "--warm-start-from without --moe-use-upcycling")
    if problems:
        return problems
    width = target.moe_ffn_hidden_size
    if dense.ffn_hidden_size % width:
        problems.append(f"moe_ffn_hidden_size: {width} does not divide the dense "
                        f"ffn_hidden_size {dense.ffn_hidden_size}; use a divisor of it")
    if target.is_latent:
        if target.latent_size < target.hidden_size:
            problems.append(
                f"latent_size: {target.latent_size} < hidden_size {target.hidden_size}: a "
                "rank-L projection cannot pass every hidden state through, so no latent layer "
                "equals the dense MLP; use latent_size >= hidden_size, or upcycle into smoe")
        if dense.ffn_hidden_size != width:
            problems.append(f"moe_ffn_hidden_size: latent upcycling copies the whole dense "
                            f"MLP into each expert (granularity 1); use {dense.ffn_hidden_size}")
        if target.multi_view.gate_scale != 1.0:
            problems.append(f"multi_view.gate_scale: {target.multi_view.gate_scale} scales "
                            "every gate, so the output would be alpha x the dense MLP; use 1.0")
    if target.add_bias_linear:
        problems.append("add_bias_linear: upcycling copies weights only (expert and router "
                        "biases are not mapped); upcycle a model trained with "
                        "--disable-bias-linear")
    if target.moe_shared_expert_intermediate_size:
        problems.append("moe_shared_expert_intermediate_size: a shared expert would add its "
                        "fresh init to the dense output; upcycle without one")
    return problems


def _pad_columns(weight_XD: torch.Tensor, width: int) -> torch.Tensor:
    out = weight_XD.new_zeros(weight_XD.shape[0], width)
    out[:, :weight_XD.shape[1]] = weight_XD
    return out


def _pad_rows(weight_DX: torch.Tensor, rows: int) -> torch.Tensor:
    out = weight_DX.new_zeros(rows, weight_DX.shape[1])
    out[:weight_DX.shape[0]] = weight_DX
    return out


def latent_upcycle_state_dict(dense: Dict[str, torch.Tensor], target: Dict[str, torch.Tensor]
                              ) -> (Dict[str, torch.Tensor], UpcycleReport):
    """The latent target's state dict with the dense weights mapped in (see module doc)."""
    merged, report = dict(target), UpcycleReport("latent")
    for key, value in target.items():
        if key in dense and (not torch.is_tensor(value) or dense[key].shape == value.shape):
            merged[key] = dense[key].clone() if torch.is_tensor(dense[key]) else dense[key]
            report.copied.append(key)
        elif key.endswith(_KEEP_SUFFIXES):
            report.kept.append(key)
        elif key.endswith(("fc1_latent_proj.weight", "fc2_latent_proj.weight")):
            merged[key] = _padded_identity(key, value)
            report.projections.append(key)
        elif _EXPERT in key:
            merged[key] = _expert_weight(dense, key, value)
            report.experts.append(key)
        else:
            raise ValueError(f"{key}: not in the dense checkpoint and not an MoE part the "
                             "upcycling initialises. Fix: upcycle from a dense model of the "
                             "same architecture (layers, hidden size, heads, vocabulary)")
    return merged, report


def _padded_identity(key: str, value_XY: torch.Tensor) -> torch.Tensor:
    """P [L, D] = [I_D; 0] (down), up-projection [D, L] = [I_D, 0]."""
    eye = torch.eye(min(value_XY.shape), dtype=value_XY.dtype, device=value_XY.device)
    if key.endswith("fc1_latent_proj.weight"):
        return _pad_rows(eye, value_XY.shape[0])
    return _pad_columns(eye, value_XY.shape[1])


def _expert_weight(dense: Dict[str, torch.Tensor], key: str, value: torch.Tensor):
    """experts.local_experts.<i>.linear_fc1 = [W1, 0]; linear_fc2 = [W2; 0]."""
    prefix = key[:key.index(_EXPERT)]
    if key.endswith("linear_fc1.weight"):
        return _pad_columns(dense[prefix + _FC1].to(value.dtype), value.shape[1])
    if key.endswith("linear_fc2.weight"):
        return _pad_rows(dense[prefix + _FC2].to(value.dtype), value.shape[0])
    raise ValueError(f"{key}: an expert tensor the latent upcycling does not know. Fix: "
                     "upcycle into experts without biases (SwiGLU fc1/fc2 only)")


def megatron_upcycle(moe_chunk: torch.nn.Module, dense_chunk: torch.nn.Module
                     ) -> UpcycleReport:
    """Megatron-Core's stock upcycling of one chunk, loaded strictly into `moe_chunk`."""
    from megatron.core.transformer.moe.upcycling_utils import upcycle_state_dict

    state = upcycle_state_dict([moe_chunk], [dense_chunk])["model"]
    moe_chunk.load_state_dict(state, strict=True)
    dense_keys = set(dense_chunk.state_dict())
    report = UpcycleReport("megatron")
    for key in state:
        expert = _EXPERT in key and not key.endswith("_extra_state")
        (report.copied if key in dense_keys else
         report.experts if expert else report.kept).append(key)
    return report


def copy_router_heads(state: Dict[str, torch.Tensor], num_experts: int) -> List[str]:
    """new_heads 'copy': every Multi-Router weight [R*E, D] gets heads 1..R-1 = head 0 (all
    heads are new in an upcycling; the dense model has no router). Returns the keys."""
    keys = [k for k, v in state.items() if k.endswith("router.weight") and torch.is_tensor(v)
            and v.shape[0] > num_experts]
    for key in keys:
        weight_XD = state[key]
        state[key] = weight_XD[:num_experts].repeat(weight_XD.shape[0] // num_experts, 1)
    return keys


def upcycle_chunk(moe_chunk: torch.nn.Module, dense_chunk: torch.nn.Module, variant: str,
                  new_heads: str = "fresh") -> UpcycleReport:
    """Map `dense_chunk`'s weights into `moe_chunk` in place (same layout, same groups);
    Multi-View gamma ramps restart at step 0 so the views start neutral. Router heads keep
    their init ("fresh") or are copies of head 0 ("copy"); either way the gates of a token
    sum to 1, so the first forward is the dense model's."""
    if not get_variant(variant).latent:
        return megatron_upcycle(moe_chunk, dense_chunk)
    merged, report = latent_upcycle_state_dict(dense_chunk.state_dict(),
                                               moe_chunk.state_dict())
    if new_heads == "copy":
        copy_router_heads(merged, moe_chunk.config.num_moe_experts)
    moe_chunk.load_state_dict(merged, strict=True)
    restart_gamma_ramps(moe_chunk)
    return report
