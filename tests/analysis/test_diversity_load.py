"""diversity and load: hand-computed cases and naive references."""
import math

import pytest
import torch

from megatron_mvmoe.functional.diversity import (
    diversity_report, head_argmax_disagreement, head_rank_correlation, head_topk_overlap,
    mixing_entropy)
from megatron_mvmoe.analysis.routing.expert_load import (
    load_report, load_stats, tokens_per_expert, tokens_per_expert_from_idx, tokens_per_rank)


def test_identical_heads_agree_fully_opposite_heads_disagree():
    gen = torch.Generator().manual_seed(0)
    s = torch.rand(50, 1, 8, generator=gen)
    same = torch.cat([s, s], dim=1)
    assert head_rank_correlation(same) == {"r0-r1": pytest.approx(1.0)}
    assert head_topk_overlap(same, 2) == {"r0-r1": 1.0}
    opposite = torch.cat([s, 1 - s], dim=1)
    assert head_rank_correlation(opposite)["r0-r1"] == pytest.approx(-1.0)
    assert head_topk_overlap(opposite, 2)["r0-r1"] == 0.0


def test_topk_overlap_hand_case_and_three_heads():
    scores = torch.tensor([[[0.9, 0.8, 0.1, 0.0],
                            [0.9, 0.1, 0.8, 0.0],
                            [0.0, 0.1, 0.8, 0.9]]])
    overlap = head_topk_overlap(scores, 2)
    assert overlap == {"r0-r1": 0.5, "r0-r2": 0.0, "r1-r2": 0.5}
    assert set(head_rank_correlation(scores)) == {"r0-r1", "r0-r2", "r1-r2"}


def test_independent_heads_overlap_near_chance():
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(4000, 2, 16, generator=gen)
    report = diversity_report(scores, scores.sum(1).topk(4, dim=1).indices.sort(1).values)
    assert report.topk_overlap["r0-r1"] == pytest.approx(report.chance_overlap, abs=0.02)
    assert abs(report.rank_correlation["r0-r1"]) < 0.03


def test_mixing_entropy_hand_cases():
    uniform = torch.full((3, 2, 4), 0.25)
    assert mixing_entropy(uniform) == pytest.approx(1.0)
    one_hot = torch.zeros(3, 2, 4)
    one_hot[..., 1] = 1.0
    assert mixing_entropy(one_hot) == 0.0
    half = torch.tensor([[[0.5, 0.5]], [[1.0, 0.0]]])
    assert mixing_entropy(half) == pytest.approx(0.5)
    mix = torch.tensor([[[0.9, 0.1]]])
    expected = -(0.9 * math.log(0.9) + 0.1 * math.log(0.1)) / math.log(2)
    assert mixing_entropy(mix) == pytest.approx(expected)
    assert mixing_entropy(torch.ones(2, 2, 1)) == 0.0


def test_argmax_disagreement():
    scores = torch.tensor([[[0.9, 0.2, 0.5], [0.1, 0.8, 0.4]]])  # head 1 leads expert 1 only
    assert head_argmax_disagreement(scores, torch.tensor([[0, 1]])) == 0.5
    assert head_argmax_disagreement(scores, torch.tensor([[0, 2]])) == 0.0


def test_load_hand_case():
    topk = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 3]])
    routing_map = torch.zeros(4, 4, dtype=torch.bool).scatter(1, topk, True)
    load = tokens_per_expert(routing_map)
    assert load.tolist() == [3, 3, 1, 1]
    assert tokens_per_expert_from_idx(topk, 4).tolist() == [3, 3, 1, 1]
    assert tokens_per_rank(load, 2).tolist() == [6, 2]
    stats = load_stats(load)
    assert stats.max_over_mean == 1.5
    assert stats.cv == pytest.approx(1.0 / 2.0)  # std of (3,3,1,1) = 1, mean 2
    assert stats.min_count == 1
    report = load_report({5: routing_map}, ep_size=2)
    assert report[0].layer == 5 and report[0].ranks.max_over_mean == 1.5
    with pytest.raises(ValueError, match="ep_size"):
        tokens_per_rank(load, 3)


def test_balanced_load():
    stats = load_stats(torch.tensor([5, 5, 5, 5]))
    assert (stats.max_over_mean, stats.cv) == (1.0, 0.0)
