"""Rank statistics for the routing analyses: average ranks, Spearman, seeded bootstrap CIs.

Legend: T tokens (rows), E experts (columns), N samples, B bootstrap resamples.

Design choices:
- Ties get the AVERAGE of the ranks they span (scipy's `rankdata(method="average")`), so
  Spearman = Pearson correlation of the average ranks, exact with ties.
- Ranks come from a sort plus two `searchsorted` calls, O(E log E) per row, batched over
  rows: per-token Spearman of [T, E] score / utility tables is one call.
- A row whose ranks are constant (all scores tied) has no defined correlation: it yields
  NaN, and the aggregations skip NaN rows and report how many were used.
- Ranks and correlations are computed in float64: average ranks are exact halves and the
  moments of E <= a few thousand ranks are exact in float64.
- The bootstrap resamples INDICES (tokens) with a seeded `torch.Generator`, so the same
  seed gives the same interval on every machine; the statistic is any function of an
  index tensor, which lets a caller resample tokens jointly across layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

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


@dataclass(frozen=True)
class Interval:
    """A point estimate with a percentile bootstrap confidence interval."""

    estimate: float
    """The statistic on the full sample."""
    low: float
    """Lower percentile bound ((1 - level) / 2)."""
    high: float
    """Upper percentile bound ((1 + level) / 2)."""
    level: float
    """Confidence level, e.g. 0.95."""
    resamples: int
    """Number of bootstrap resamples B (0: no interval, low = high = estimate)."""

    def as_dict(self) -> dict:
        return {"estimate": self.estimate, "low": self.low, "high": self.high,
                "level": self.level, "resamples": self.resamples}


def bootstrap_ci(
    statistic: Callable[[torch.Tensor], float],
    num_samples: int,
    resamples: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> Interval:
    """Percentile bootstrap interval for `statistic(indices)` over `num_samples` items.

    Args:
        statistic: maps an int64 index tensor [N] (with repeats) to a float; it is called
            once with arange(N) for the estimate and `resamples` times with resampled indices.
        num_samples: N, the number of items (tokens) to resample.
        resamples: B; 0 skips the interval.
        level: confidence level in (0, 1).
        seed: seeds the torch.Generator, so the interval is reproducible.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples: need >= 1 item, got {num_samples}. Fix: pass tokens")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level: must be in (0, 1), got {level}. Fix: use 0.95")
    if resamples < 0:
        raise ValueError(f"resamples: must be >= 0, got {resamples}. Fix: use 1000")
    estimate = float(statistic(torch.arange(num_samples)))
    if resamples == 0:
        return Interval(estimate, estimate, estimate, level, 0)
    gen = torch.Generator().manual_seed(seed)
    draws_B = torch.tensor([
        float(statistic(torch.randint(0, num_samples, (num_samples,), generator=gen)))
        for _ in range(resamples)
    ], dtype=torch.float64)
    draws_B = draws_B[~torch.isnan(draws_B)]
    if draws_B.numel() == 0:
        return Interval(estimate, float("nan"), float("nan"), level, resamples)
    tail = (1.0 - level) / 2.0
    low, high = torch.quantile(draws_B, torch.tensor([tail, 1.0 - tail], dtype=torch.float64))
    return Interval(estimate, float(low), float(high), level, resamples)


def mean_std(values) -> tuple:
    """(mean, sample std with ddof=1; 0 for a single value) of a sequence of floats."""
    data = torch.tensor(list(values), dtype=torch.float64)
    if data.numel() == 0:
        raise ValueError("values: empty. Fix: pass at least one value")
    std = float(data.std(unbiased=True)) if data.numel() > 1 else 0.0
    return float(data.mean()), std


# ------------------------------------------------------------------ paired comparisons
def student_t_cdf(x: float, df: int) -> float:
    """CDF of Student's t with `df` degrees of freedom (Simpson's rule on the density from
    0 to |x|, 2000 panels; error < 1e-9 for df >= 1 and |x| < 50; no SciPy needed)."""
    if df < 1:
        raise ValueError(f"df: need >= 1 degree of freedom, got {df}. Fix: use >= 2 seeds")
    log_norm = (math.lgamma((df + 1) / 2) - math.lgamma(df / 2)
                - 0.5 * math.log(df * math.pi))
    density = lambda t: math.exp(log_norm - (df + 1) / 2 * math.log1p(t * t / df))  # noqa
    upper, panels = min(abs(x), 50.0), 2000
    h = upper / panels
    total = density(0.0) + density(upper) + sum(
        (4 if i % 2 else 2) * density(i * h) for i in range(1, panels))
    half = total * h / 3
    return 0.5 + half if x >= 0 else 0.5 - half


def student_t_quantile(p: float, df: int) -> float:
    """Inverse of `student_t_cdf` by bisection (to 1e-10)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p: must be in (0, 1), got {p}. Fix: use e.g. 0.975")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    low, high = 0.0, 50.0
    while high - low > 1e-10:
        mid = (low + high) / 2
        low, high = (mid, high) if student_t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


@dataclass(frozen=True)
class PairedDifference:
    """Paired t analysis of per-seed differences d_i = variant_i - reference_i."""

    mean: float
    """Mean difference."""
    std: float
    """Sample std (ddof = 1) of the differences."""
    n: int
    """Pairs (seeds)."""
    low: float
    """Lower bound of the two-sided `level` t confidence interval of the mean."""
    high: float
    """Upper bound."""
    t: float
    """mean / (std / sqrt(n)); inf when std = 0 and mean != 0."""
    detectable: float
    """Smallest |true mean difference| this design detects with probability `power` at
    two-sided level 1 - `level`: (t_{1-a/2, n-1} + t_{power, n-1}) std / sqrt(n), using the
    observed std (a planning figure, not a guarantee)."""
    level: float
    power: float

    def verdict(self) -> str:
        """'lower' / 'higher' when the interval excludes 0, else 'unresolved'."""
        if self.high < 0:
            return "lower"
        if self.low > 0:
            return "higher"
        return "unresolved"

    def as_dict(self) -> dict:
        return dict(mean=self.mean, std=self.std, n=self.n, low=self.low, high=self.high,
                    t=self.t, detectable=self.detectable, level=self.level, power=self.power,
                    verdict=self.verdict())


def paired_difference(deltas, level: float = 0.95, power: float = 0.8) -> PairedDifference:
    """Paired t interval and smallest detectable difference of per-seed differences."""
    values = [float(d) for d in deltas]
    if len(values) < 2:
        raise ValueError(f"deltas: need >= 2 paired seeds, got {len(values)}. Fix: run "
                         "more seeds (--seeds 5)")
    mean, std = mean_std(values)
    n = len(values)
    se = std / math.sqrt(n)
    crit = student_t_quantile(0.5 + level / 2, n - 1)
    t = mean / se if se > 0 else (0.0 if mean == 0 else math.copysign(math.inf, mean))
    detectable = (crit + student_t_quantile(power, n - 1)) * se
    return PairedDifference(mean, std, n, mean - crit * se, mean + crit * se, t, detectable,
                            level, power)
