"""Routing score-utility alignment (seed 000, Figure 2 / Table 2): Spearman rho per layer.

Legend: T tokens, E experts, S selected slots (top-k), L latent size, D hidden size,
R routing heads.

What the paper measures and how we read it:
- "Dense evaluation of all experts": every expert is run on every token, so each token has
  a full row of E router scores and E utilities.
- "single-router score RANKINGS vs rankings from empirical expert-utility evaluations":
  the object ranked is the set of experts FOR ONE TOKEN. So the primary statistic is the
  PER-TOKEN Spearman rho over the E experts, averaged over tokens within a layer (per-layer
  rho) and over all (layer, token) pairs (global rho; with the same tokens at every layer
  this equals the mean of the per-layer values). A pooled variant (one Spearman over all
  T*E pairs of a layer) is also reported, because the normalised-norm utility is only
  comparable across tokens once normalised; it is secondary.
- The router score is the UNBIASED summed score s_bar_i = sum_r s_{r,i} (Eq. 2): what the
  routers believe, before the balancing bias, which is a load device, not an assessment.
  For R = 1 it is the single sigmoid score.
- Utilities (both [T, E], larger = more useful):
  * normalised output norm u_i = ||E_i(x_i)|| / sum_j ||E_j(x_j)|| (the paper's), where
    x_i is what expert i would receive (the shared latent, or its Multi-View blend);
  * loss change: NLL with expert i forced OUT of the selection minus NLL with it forced IN
    (the other selected experts and their gates unchanged). See `forced_loss_utility`.
- Tokens whose score or utility row is constant (undefined rho) are skipped and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Union

import torch

from megatron_mvmoe.analysis.stats import Interval, bootstrap_ci
from megatron_mvmoe.functional import gate_denominator
from megatron_mvmoe.functional.ranks import nanmean, spearman, spearman_rows


def normalised_output_norm(expert_out_TEL: torch.Tensor) -> torch.Tensor:
    """u_i = ||E_i(x)|| / sum_j ||E_j(x)|| per token: [T, E, L] -> [T, E] (rows sum to 1)."""
    if expert_out_TEL.dim() != 3:
        raise ValueError(f"expert_out_TEL: expected [T, E, L], got {tuple(expert_out_TEL.shape)}. "
                         "Fix: stack every expert's output on every token")
    norms_TE = torch.linalg.vector_norm(expert_out_TEL.to(torch.float64), dim=-1)
    total_T1 = norms_TE.sum(dim=-1, keepdim=True)
    return norms_TE / torch.where(total_T1 > 0, total_T1, torch.ones_like(total_T1))


def forced_gates(
    summed_TE: torch.Tensor, topk_idx_TS: torch.Tensor, alpha: Union[float, torch.Tensor] = 1.0,
    num_routers: int = 1, eps: float = 1e-6,
) -> torch.Tensor:
    """The gate every expert gets when toggled, [T, E].

    A selected expert keeps its own gate (Eq. 3); an unselected one forced in gets the gate
    it would have with the CURRENT selection's normaliser (Eq. 3's, floored at `eps`, the
    config's normalizer_eps), alpha_i s_bar_i / max(sum_{j in S} s_bar_j, eps)
    (k = 1: alpha_i s_bar_i / R), from functional.gate_denominator.
    """
    gates_TE = summed_TE / gate_denominator(summed_TE, topk_idx_TS, eps, num_routers)
    if isinstance(alpha, torch.Tensor) and alpha.dim() == 1:
        return gates_TE * alpha.unsqueeze(0)
    return gates_TE * alpha


def toggle_signs(topk_idx_TS: torch.Tensor, num_experts: int) -> torch.Tensor:
    """-1 where expert i is selected (toggling removes it), +1 where not (toggling adds it)."""
    selected_TE = torch.zeros(topk_idx_TS.shape[0], num_experts, dtype=torch.bool,
                              device=topk_idx_TS.device).scatter(1, topk_idx_TS, True)
    return torch.where(selected_TE, -1.0, 1.0)


def forced_loss_utility(
    nll_base_T: torch.Tensor, nll_toggled_TE: torch.Tensor, topk_idx_TS: torch.Tensor
) -> torch.Tensor:
    """Loss-change utility [T, E]: NLL without expert i minus NLL with it.

    Args:
        nll_base_T: per-token NLL of the unmodified model.
        nll_toggled_TE: per-token NLL with expert i toggled (removed if selected, added if not).
        topk_idx_TS: the layer's selection.

    For a selected i: u = NLL(out) - NLL(base); for an unselected i: u = NLL(base) - NLL(in).
    Both are "how much loss expert i saves", so they rank on one scale.
    """
    signs_TE = toggle_signs(topk_idx_TS, nll_toggled_TE.shape[1]).to(torch.float64)
    delta_TE = nll_toggled_TE.to(torch.float64) - nll_base_T.to(torch.float64).unsqueeze(1)
    return -signs_TE * delta_TE


@dataclass
class LayerAlignment:
    """Alignment of one layer's router scores with one utility."""

    layer: int
    """Layer index (as given by the caller)."""
    per_token: Interval
    """Mean per-token Spearman rho with its bootstrap CI over tokens."""
    pooled: float
    """Spearman rho over all T*E (score, utility) pairs of the layer (secondary)."""
    tokens_used: int
    """Tokens with a defined rho (non-constant rows)."""
    tokens_total: int
    """Tokens evaluated."""

    def as_dict(self) -> dict:
        return {"layer": self.layer, "per_token": self.per_token.as_dict(),
                "pooled": self.pooled, "tokens_used": self.tokens_used,
                "tokens_total": self.tokens_total}


@dataclass
class AlignmentReport:
    """Per-layer and global alignment for one model and one utility."""

    layers: List[LayerAlignment] = field(default_factory=list)
    global_rho: Interval = None
    """Mean per-token rho over all (layer, token) pairs, CI from resampling tokens jointly."""

    def as_dict(self) -> dict:
        return {"layers": [layer.as_dict() for layer in self.layers],
                "global": self.global_rho.as_dict() if self.global_rho else None}


def alignment_report(
    scores_by_layer: Mapping[int, torch.Tensor],
    utility_by_layer: Mapping[int, torch.Tensor],
    resamples: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> AlignmentReport:
    """Per-token Spearman per layer and globally, with seeded bootstrap CIs over tokens.

    Args:
        scores_by_layer: layer -> router scores [T, E] (the same T tokens at every layer).
        utility_by_layer: layer -> utilities [T, E].
        resamples, level, seed: bootstrap settings (stats.bootstrap_ci).
    """
    if set(scores_by_layer) != set(utility_by_layer):
        raise ValueError("scores_by_layer and utility_by_layer cover different layers. "
                         "Fix: evaluate scores and utilities on the same layers")
    if not scores_by_layer:
        raise ValueError("scores_by_layer: empty. Fix: pass at least one MoE layer")
    rho_by_layer: Dict[int, torch.Tensor] = {
        layer: spearman_rows(scores_by_layer[layer], utility_by_layer[layer])
        for layer in sorted(scores_by_layer)
    }
    num_tokens = {rho.shape[0] for rho in rho_by_layer.values()}
    if len(num_tokens) != 1:
        raise ValueError(f"layers have different token counts {sorted(num_tokens)}. "
                         "Fix: evaluate every layer on the same tokens")
    report = AlignmentReport()
    for layer, rho_T in rho_by_layer.items():
        interval = bootstrap_ci(lambda idx, r=rho_T: nanmean(r[idx]), rho_T.shape[0],
                                resamples, level, seed)
        pooled = spearman(scores_by_layer[layer].reshape(-1), utility_by_layer[layer].reshape(-1))
        used = int((~torch.isnan(rho_T)).sum())
        report.layers.append(LayerAlignment(layer, interval, pooled, used, rho_T.shape[0]))
    rho_LT = torch.stack(list(rho_by_layer.values()))
    report.global_rho = bootstrap_ci(lambda idx: nanmean(rho_LT[:, idx]), rho_LT.shape[1],
                                     resamples, level, seed)
    return report
