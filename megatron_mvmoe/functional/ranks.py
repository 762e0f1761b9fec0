"""Rank correlation in pure torch: average ranks, Pearson and Spearman per row, NaN-aware
mean. Shared by the trainer's router-diversity metrics (functional/diversity.py) and the
routing analyses (analysis/routing/alignment.py, analysis/stats.py's bootstrap).

Legend: T tokens (rows), E experts (columns), N samples.

Design choices:
- Ties get the AVERAGE of the ranks they span (scipy's `rankdata(method="average")`), so
  Spearman = Pearson correlation of the average ranks, exact with ties.
- Ranks come from a sort plus two `searchsorted` calls, O(E log E) per row, batched over
  rows: per-token Spearman of [T, E] score / utility tables is one call.
- A row whose ranks are constant (all scores tied) has no defined correlation: it yields
  NaN, and `nanmean` skips NaN rows.
- Ranks and correlations are computed in float64: average ranks are exact halves and the
  moments of E <= a few thousand ranks are exact in float64.
"""

from __future__ import annotations

import torch


def average_ranks(values_TE: torch.Tensor) -> torch.Tensor:
    """1-based average ranks along the last dim (ties share the mean of their ranks).

    Args:
        values_TE: [..., E] real values (any float or int dtype). NaN is rejected.

    Returns:
        ranks_TE [..., E] float64.
    """
    if values_TE.dim() == 0:
        raise ValueError("values_TE: need at least one dimension. Fix: pass a 1-D or 2-D tensor")
    values = values_TE.detach().to(torch.float64)
    if torch.isnan(values).any():
        raise ValueError("values_TE: contains NaN. Fix: drop or impute NaN entries first")
    sorted_TE = torch.sort(values, dim=-1).values.contiguous()
    below_TE = torch.searchsorted(sorted_TE, values.contiguous(), right=False)
    through_TE = torch.searchsorted(sorted_TE, values.contiguous(), right=True)
    # the tied block occupies 0-based positions [below, through); its mean 1-based rank
    return (below_TE + through_TE + 1).to(torch.float64) / 2.0


def pearson_rows(x_TE: torch.Tensor, y_TE: torch.Tensor) -> torch.Tensor:
    """Pearson correlation of each row pair [..., E] -> [...]; NaN where a row is constant."""
    x = x_TE.to(torch.float64)
    y = y_TE.to(torch.float64)
    xc = x - x.mean(dim=-1, keepdim=True)
    yc = y - y.mean(dim=-1, keepdim=True)
    cov = (xc * yc).sum(dim=-1)
    norm = torch.sqrt((xc * xc).sum(dim=-1) * (yc * yc).sum(dim=-1))
    nan = torch.full_like(cov, float("nan"))
    return torch.where(norm > 0, cov / torch.where(norm > 0, norm, torch.ones_like(norm)), nan)


def spearman_rows(x_TE: torch.Tensor, y_TE: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation of each row pair: [T, E] x [T, E] -> rho_T (float64).

    Rows with constant x or y give NaN (undefined correlation).
    """
    if x_TE.shape != y_TE.shape:
        raise ValueError(f"x_TE {tuple(x_TE.shape)} and y_TE {tuple(y_TE.shape)} differ. "
                         "Fix: pass scores and utilities for the same tokens and experts")
    if x_TE.shape[-1] < 2:
        raise ValueError("need at least 2 columns (experts) to rank. Fix: use E >= 2")
    return pearson_rows(average_ranks(x_TE), average_ranks(y_TE))


def spearman(x_N: torch.Tensor, y_N: torch.Tensor) -> float:
    """Spearman rank correlation of two 1-D samples (pooled; ties by average ranks)."""
    return float(spearman_rows(x_N.reshape(1, -1), y_N.reshape(1, -1))[0])


def nanmean(values: torch.Tensor) -> float:
    """Mean over the non-NaN entries; NaN if there are none."""
    kept = values[~torch.isnan(values)]
    return float(kept.mean()) if kept.numel() else float("nan")
