"""stats: average ranks, Spearman with ties, bootstrap CIs, against naive references."""
import math
import random

import pytest
import torch

from megatron_mvmoe.analysis.stats import bootstrap_ci, mean_std
from megatron_mvmoe.functional.ranks import average_ranks, spearman, spearman_rows


def naive_ranks(values):
    """O(n^2) average ranks: 1 + #smaller + (#equal - 1) / 2."""
    return [1 + sum(v < x for v in values) + (sum(v == x for v in values) - 1) / 2
            for x in values]


def naive_spearman(x, y):
    rx, ry = naive_ranks(x), naive_ranks(y)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx)
    vy = sum((b - my) ** 2 for b in ry)
    return cov / math.sqrt(vx * vy)


def test_average_ranks_hand_case():
    assert average_ranks(torch.tensor([10.0, 20.0, 20.0, 5.0])).tolist() == [2.0, 3.5, 3.5, 1.0]
    assert average_ranks(torch.tensor([1, 1, 1])).tolist() == [2.0, 2.0, 2.0]


def test_average_ranks_matches_naive_with_ties():
    rng = random.Random(0)
    for _ in range(20):
        values = [rng.randint(0, 4) for _ in range(9)]
        assert average_ranks(torch.tensor(values, dtype=torch.float32)).tolist() == naive_ranks(values)


def test_spearman_hand_cases():
    # no ties: rho = 1 - 6 sum d^2 / (n (n^2 - 1)); ranks (1,2,3,4) vs (2,1,4,3): d^2 = 4
    assert spearman(torch.tensor([1., 2., 3., 4.]), torch.tensor([2., 1., 4., 3.])) == pytest.approx(0.6)
    assert spearman(torch.tensor([1., 2., 3.]), torch.tensor([30., 20., 10.])) == pytest.approx(-1.0)
    # monotone but nonlinear -> 1
    x = torch.linspace(-2, 2, 11)
    assert spearman(x, x.exp()) == pytest.approx(1.0)


def test_spearman_rows_matches_naive_with_ties():
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 3, (25, 6), generator=gen).float()
    y = torch.randint(0, 3, (25, 6), generator=gen).float()
    rho = spearman_rows(x, y)
    for t in range(25):
        xs, ys = x[t].tolist(), y[t].tolist()
        if len(set(xs)) == 1 or len(set(ys)) == 1:
            assert math.isnan(rho[t])
        else:
            assert float(rho[t]) == pytest.approx(naive_spearman(xs, ys), abs=1e-12)


def test_spearman_rejects_bad_input():
    with pytest.raises(ValueError, match="differ"):
        spearman_rows(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="NaN"):
        average_ranks(torch.tensor([1.0, float("nan")]))


def test_bootstrap_is_seeded_and_brackets_estimate():
    gen = torch.Generator().manual_seed(2)
    data = torch.randn(400, generator=gen, dtype=torch.float64) + 3.0
    stat = lambda idx: float(data[idx].mean())  # noqa: E731
    a = bootstrap_ci(stat, 400, resamples=300, seed=7)
    b = bootstrap_ci(stat, 400, resamples=300, seed=7)
    c = bootstrap_ci(stat, 400, resamples=300, seed=8)
    assert a == b and a != c
    assert a.low < a.estimate < a.high
    # standard error of the mean is 1/sqrt(400) = 0.05: the 95% interval is about +-0.1
    assert 0.12 < a.high - a.low < 0.28
    assert a.estimate == pytest.approx(float(data.mean()))


def test_bootstrap_zero_resamples_and_errors():
    iv = bootstrap_ci(lambda idx: 1.5, 3, resamples=0)
    assert (iv.low, iv.estimate, iv.high) == (1.5, 1.5, 1.5)
    with pytest.raises(ValueError, match="level"):
        bootstrap_ci(lambda idx: 0.0, 3, level=1.5)


def test_mean_std():
    assert mean_std([1.0, 2.0, 3.0]) == pytest.approx((2.0, 1.0))
    assert mean_std([4.0]) == (4.0, 0.0)
