"""Statistics for the routing analyses and the comparisons: seeded bootstrap CIs, mean and
spread, Student t, paired differences (the rank correlations themselves are pure math in
functional/ranks.py).

Legend: N samples, B bootstrap resamples.

Design choices:
- The bootstrap resamples INDICES (tokens) with a seeded `torch.Generator`, so the same
  seed gives the same interval on every machine; the statistic is any function of an
  index tensor, which lets a caller resample tokens jointly across layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


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
