"""Router diversity (seed 000, "self-stabilizing router diversity"): how differently the R
routing heads of one layer rank the experts, and how much the view blends mix.

Legend: T tokens, E experts, R routing heads (= K views), S selected slots (top-k).

Design choices:
- Inter-router agreement is measured per token (Spearman over the E experts between head r
  and head r', then averaged over tokens), the same per-token reading as the alignment
  analysis; pairs are r < r'.
- Top-k overlap between heads is |topk(s_r) ∩ topk(s_r')| / k per token: 1 = the heads
  would pick the same experts on their own, k/E is what independent heads give on average.
- Mixing entropy is H(a_{., i}) / log R per (token, selected slot), in [0, 1]: 1 = uniform
  blend (views treated alike), 0 = one view only. R = 1 has no blend and reports 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import combinations
from math import log
from typing import Dict, Optional

import torch

from megatron_mvmoe.functional.ranks import nanmean, spearman_rows


def head_rank_correlation(scores_TRE: torch.Tensor) -> Dict[str, float]:
    """Mean per-token Spearman between every pair of heads: {"r0-r1": rho, ...}."""
    _check_scores(scores_TRE)
    return {f"r{a}-r{b}": nanmean(spearman_rows(scores_TRE[:, a], scores_TRE[:, b]))
            for a, b in combinations(range(scores_TRE.shape[1]), 2)}


def head_topk_overlap(scores_TRE: torch.Tensor, k: int) -> Dict[str, float]:
    """Mean |topk(head a) ∩ topk(head b)| / k per pair of heads."""
    _check_scores(scores_TRE)
    num_experts = scores_TRE.shape[2]
    if not 1 <= k <= num_experts:
        raise ValueError(f"k: must be in [1, {num_experts}], got {k}. Fix: use moe_router_topk")
    chosen_TRE = torch.zeros_like(scores_TRE, dtype=torch.bool).scatter(
        2, scores_TRE.topk(k, dim=2).indices, True)
    return {f"r{a}-r{b}": float((chosen_TRE[:, a] & chosen_TRE[:, b]).sum(-1).double().mean() / k)
            for a, b in combinations(range(scores_TRE.shape[1]), 2)}


def mixing_entropy(mix_TSR: torch.Tensor) -> float:
    """Mean normalised entropy H(a) / log R of the view blends of the selected slots."""
    if mix_TSR.dim() != 3:
        raise ValueError(f"mix_TSR: expected [T, S, R], got {tuple(mix_TSR.shape)}. "
                         "Fix: pass RoutingOutput.mix_TSR")
    num_heads = mix_TSR.shape[2]
    if num_heads == 1:
        return 0.0
    probs = mix_TSR.to(torch.float64).clamp_min(0)
    plogp = torch.where(probs > 0, probs * probs.log(), torch.zeros_like(probs))
    return float((-plogp.sum(-1) / log(num_heads)).mean())


def head_argmax_disagreement(scores_TRE: torch.Tensor, topk_idx_TS: torch.Tensor) -> float:
    """Fraction of selected (token, expert) slots whose largest head score is NOT head 0:
    0 when one head dominates every blend, (R-1)/R when preferences split evenly."""
    _check_scores(scores_TRE)
    idx_TRS = topk_idx_TS.unsqueeze(1).expand(-1, scores_TRE.shape[1], -1)
    selected_TRS = scores_TRE.gather(2, idx_TRS)
    return float((selected_TRS.argmax(dim=1) != 0).double().mean())


@dataclass
class DiversityReport:
    """Router diversity of one layer."""

    num_heads: int
    """R."""
    rank_correlation: Dict[str, float] = field(default_factory=dict)
    """Per head pair: mean per-token Spearman over experts."""
    topk_overlap: Dict[str, float] = field(default_factory=dict)
    """Per head pair: mean top-k overlap fraction."""
    chance_overlap: float = 0.0
    """k / E: expected overlap of two independent random top-k sets."""
    mixing_entropy: Optional[float] = None
    """Mean normalised blend entropy (None when the layer does not mix views)."""
    argmax_disagreement: float = 0.0
    """Fraction of selected slots led by a head other than head 0."""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def diversity_report(scores_TRE: torch.Tensor, topk_idx_TS: torch.Tensor,
                     mix_TSR: Optional[torch.Tensor] = None) -> DiversityReport:
    """All diversity measures for one layer's routing output."""
    _check_scores(scores_TRE)
    k, num_experts = topk_idx_TS.shape[1], scores_TRE.shape[2]
    return DiversityReport(
        num_heads=scores_TRE.shape[1],
        rank_correlation=head_rank_correlation(scores_TRE) if scores_TRE.shape[1] > 1 else {},
        topk_overlap=head_topk_overlap(scores_TRE, k) if scores_TRE.shape[1] > 1 else {},
        chance_overlap=k / num_experts,
        mixing_entropy=None if mix_TSR is None else mixing_entropy(mix_TSR),
        argmax_disagreement=head_argmax_disagreement(scores_TRE, topk_idx_TS),
    )


def _check_scores(scores_TRE: torch.Tensor) -> None:
    if scores_TRE.dim() != 3:
        raise ValueError(f"scores_TRE: expected [T, R, E], got {tuple(scores_TRE.shape)}. "
                         "Fix: pass RoutingOutput.scores_TRE")
