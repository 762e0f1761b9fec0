"""Routing maps for the all-to-all model: balanced, skewed (Zipf-like) and a trained model's
measured load profile, for P EP ranks x T tokens x E experts: `routing_maps(model, ...)`.

Legend: P EP ranks, T tokens per rank, E experts, k experts per token.

Design choices:
- "balanced" is Megatron's `moe_router_force_load_balancing`: i.i.d. standard-normal logits
  (`RandomSTE`), then the top-k; every expert is equally likely, only sampling noise skews.
- "skewed": expert popularity p_e proportional to 1 / (r_e + 1)^s (Zipf with exponent
  s = `load`) over popularity ranks r_e; a seeded permutation places the popular experts
  on random EP ranks (not all on rank 0). Each token draws k distinct experts with
  probability proportional to p (Gumbel top-k = sampling without replacement).
- "profile" (a checkpoint's real routing): the trained model's per-expert share of
  assignments, sorted and linearly interpolated to E experts, drawn as "skewed" is. It
  keeps how uneven the trained router is, not which experts co-occur in a token.
- Load of a rank = (token, expert) assignments it hosts (rows its experts compute).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

MODELS = ("balanced", "skewed", "profile")


def _gumbel_topk(log_p_E: torch.Tensor, ranks: int, tokens: int, topk: int,
                 gen: torch.Generator) -> torch.Tensor:
    uniform = torch.rand(ranks, tokens, log_p_E.numel(), generator=gen).clamp_(1e-12, 1.0)
    keys = log_p_E - torch.log(-torch.log(uniform))
    return _topk_map(keys, topk)


def _topk_map(scores_PTE: torch.Tensor, topk: int) -> torch.Tensor:
    idx = scores_PTE.topk(topk, dim=-1).indices
    return torch.zeros_like(scores_PTE, dtype=torch.bool).scatter_(-1, idx, True)


def zipf_popularity(num_experts: int, exponent: float, gen: torch.Generator) -> torch.Tensor:
    """p_E summing to 1: 1/(r+1)^s over a seeded random assignment of ranks r to experts."""
    if exponent < 0:
        raise ValueError(f"load: the Zipf exponent must be >= 0, got {exponent}. "
                         "Fix: pass --load 0 (uniform) or larger")
    weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent
    return (weights / weights.sum())[torch.randperm(num_experts, generator=gen)]


def profile_popularity(shares: Sequence[float], num_experts: int,
                       gen: torch.Generator) -> torch.Tensor:
    """A measured load profile (any number of experts) stretched to `num_experts`."""
    sorted_ = torch.tensor(sorted(shares, reverse=True), dtype=torch.float64)
    if sorted_.numel() < 1 or float(sorted_.sum()) <= 0:
        raise ValueError("shares: the load profile is empty. Fix: measure a routed model")
    pos = torch.linspace(0, sorted_.numel() - 1, num_experts, dtype=torch.float64)
    lo = pos.floor().long().clamp(max=sorted_.numel() - 1)
    hi = (lo + 1).clamp(max=sorted_.numel() - 1)
    frac = pos - lo
    values = (sorted_[lo] * (1 - frac) + sorted_[hi] * frac).clamp_min(1e-12)
    return (values / values.sum())[torch.randperm(num_experts, generator=gen)]


def routing_maps(model: str, ranks: int, tokens: int, num_experts: int, topk: int,
                 load: float = 1.0, shares: Optional[Sequence[float]] = None,
                 seed: int = 0) -> torch.Tensor:
    """Bool routing maps [P, T, E] with exactly k experts per token."""
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk: {topk} must be in [1, {num_experts}]")
    gen = torch.Generator().manual_seed(seed)
    if model == "balanced":
        return _topk_map(torch.randn(ranks, tokens, num_experts, generator=gen), topk)
    if model == "skewed":
        p_E = zipf_popularity(num_experts, load, gen)
    elif model == "profile":
        if shares is None:
            raise ValueError("shares: the profile model needs a measured load profile. "
                             "Fix: pass --routing checkpoint with --checkpoint DIR")
        p_E = profile_popularity(shares, num_experts, gen)
    else:
        raise ValueError(f"routing: unknown {model!r}. Fix: use one of {MODELS}")
    return _gumbel_topk(p_E.log().float(), ranks, tokens, topk, gen)


def rank_loads(maps_PTE: torch.Tensor, ep: int) -> torch.Tensor:
    """Assignments hosted by each EP rank [P] (contiguous experts)."""
    per_expert = maps_PTE.reshape(-1, maps_PTE.shape[-1]).long().sum(0)
    return per_expert.view(ep, -1).sum(1)


def max_over_mean(values: torch.Tensor) -> float:
    values = values.double()
    return float(values.max() / values.mean()) if float(values.mean()) > 0 else 0.0
