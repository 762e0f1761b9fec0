"""Expert load: tokens per expert, max/mean, coefficient of variation, per layer and EP rank.

Legend: T tokens, E experts, S selected slots (top-k), P expert-parallel ranks.

Design choices:
- Load counts (token, slot) assignments, i.e. rows an expert computes: sum of the routing
  map's column, k per token in total.
- Experts sit on EP ranks in Megatron's contiguous layout: rank p holds experts
  [p*E/P, (p+1)*E/P) (`MoELayer.local_expert_indices`), so a rank's load is the sum over
  its block; it is what that rank receives in the dispatch all-to-all.
- max/mean = 1 and CV = 0 mean perfectly balanced; CV uses the population std (ddof = 0)
  over experts, the usual balance measure (a fixed set of E experts, not a sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping

import torch


def tokens_per_expert(routing_map_TE: torch.Tensor) -> torch.Tensor:
    """Assignments per expert [E] (int64) from a bool routing map [T, E]."""
    if routing_map_TE.dim() != 2:
        raise ValueError(f"routing_map_TE: expected [T, E], got {tuple(routing_map_TE.shape)}. "
                         "Fix: flatten tokens first")
    return routing_map_TE.to(torch.int64).sum(dim=0)


def tokens_per_expert_from_idx(topk_idx_TS: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert [E] from the slot form [T, S]."""
    return torch.bincount(topk_idx_TS.reshape(-1), minlength=num_experts).to(torch.int64)


def tokens_per_rank(load_E: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Assignments per EP rank [P] under the contiguous expert layout."""
    num_experts = load_E.shape[0]
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"ep_size: {ep_size} must divide the {num_experts} experts. "
                         "Fix: pick an EP size that divides num_moe_experts")
    return load_E.view(ep_size, num_experts // ep_size).sum(dim=1)


@dataclass(frozen=True)
class LoadStats:
    """Balance of one load vector (over experts or over EP ranks)."""

    counts: List[int]
    """Assignments per expert (or per rank)."""
    max_over_mean: float
    """max / mean (1 = balanced)."""
    cv: float
    """Coefficient of variation std / mean (population std; 0 = balanced)."""
    min_count: int
    """Least-loaded expert's (rank's) assignments (0 = a dead expert)."""

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def load_stats(load_E: torch.Tensor) -> LoadStats:
    counts = load_E.to(torch.float64)
    mean = counts.mean()
    if mean <= 0:
        return LoadStats(load_E.tolist(), float("nan"), float("nan"), int(load_E.min()))
    return LoadStats(
        counts=[int(c) for c in load_E.tolist()],
        max_over_mean=float(counts.max() / mean),
        cv=float(counts.std(unbiased=False) / mean),
        min_count=int(load_E.min()),
    )


@dataclass(frozen=True)
class LayerLoad:
    """Expert and EP-rank balance of one layer."""

    layer: int
    experts: LoadStats
    ranks: LoadStats

    def as_dict(self) -> dict:
        return {"layer": self.layer, "experts": self.experts.as_dict(),
                "ranks": self.ranks.as_dict()}


def load_report(routing_maps: Mapping[int, torch.Tensor], ep_size: int = 1) -> List[LayerLoad]:
    """Per layer: expert load and per-EP-rank load from routing maps [T, E]."""
    report = []
    for layer in sorted(routing_maps):
        load_E = tokens_per_expert(routing_maps[layer])
        report.append(LayerLoad(layer, load_stats(load_E),
                                load_stats(tokens_per_rank(load_E, ep_size))))
    return report
