"""alignment: per-token Spearman of router scores vs utilities; synthetic layers."""
import math

import pytest
import torch

from megatron_mvmoe.analysis.routing.alignment import (
    alignment_report, forced_gates, forced_loss_utility, normalised_output_norm, toggle_signs)


def test_normalised_output_norm_hand_case():
    out = torch.zeros(1, 3, 2)
    out[0, 0] = torch.tensor([3.0, 4.0])   # norm 5
    out[0, 1] = torch.tensor([0.0, 5.0])   # norm 5
    out[0, 2] = torch.tensor([0.0, 10.0])  # norm 10
    assert normalised_output_norm(out).tolist() == [[0.25, 0.25, 0.5]]


def test_matched_utility_gives_rho_one_and_shuffled_about_zero():
    gen = torch.Generator().manual_seed(0)
    T, E, L = 2000, 16, 8
    scores = torch.rand(T, E, generator=gen)
    # expert outputs whose norm grows with the router score: utility constructed to match
    directions = torch.nn.functional.normalize(torch.randn(T, E, L, generator=gen), dim=-1)
    outputs = directions * (0.1 + scores).unsqueeze(-1)
    utility = normalised_output_norm(outputs)
    report = alignment_report({0: scores, 1: scores}, {0: utility, 1: utility}, resamples=50)
    assert report.layers[0].per_token.estimate == pytest.approx(1.0)
    assert report.global_rho.estimate == pytest.approx(1.0)
    assert report.layers[0].pooled > 0.9  # pooled is not exactly 1: utilities are normalised

    shuffled = scores[:, torch.randperm(E, generator=gen)]
    report = alignment_report({0: shuffled}, {0: utility}, resamples=200, seed=3)
    layer = report.layers[0]
    assert abs(layer.per_token.estimate) < 0.05
    assert layer.per_token.low < 0.0 < layer.per_token.high or abs(layer.per_token.estimate) < 0.02


def test_report_layers_and_global_is_mean_of_layers():
    gen = torch.Generator().manual_seed(1)
    T, E = 300, 6
    util = torch.rand(T, E, generator=gen)
    noisy = util + 0.3 * torch.rand(T, E, generator=gen)
    anti = -util
    report = alignment_report({3: noisy, 7: anti}, {3: util, 7: util}, resamples=20)
    assert [layer.layer for layer in report.layers] == [3, 7]
    assert report.layers[1].per_token.estimate == pytest.approx(-1.0)
    mean_layers = (report.layers[0].per_token.estimate + report.layers[1].per_token.estimate) / 2
    assert report.global_rho.estimate == pytest.approx(mean_layers)
    assert report.as_dict()["global"]["resamples"] == 20


def test_constant_rows_are_skipped_and_counted():
    scores = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]])
    util = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    layer = alignment_report({0: scores}, {0: util}, resamples=0).layers[0]
    assert (layer.tokens_used, layer.tokens_total) == (1, 2)
    assert layer.per_token.estimate == 1.0


def test_forced_gates_and_loss_utility_hand_case():
    summed = torch.tensor([[0.2, 0.6, 0.4, 0.1]])
    topk = torch.tensor([[1, 2]])
    gates = forced_gates(summed, topk)
    assert gates[0].tolist() == pytest.approx([0.2, 0.6, 0.4, 0.1])  # normaliser 0.6 + 0.4 = 1
    assert forced_gates(summed, topk[:, :1], num_routers=2)[0].tolist() == pytest.approx(
        [0.1, 0.3, 0.2, 0.05])
    assert toggle_signs(topk, 4).tolist() == [[1.0, -1.0, -1.0, 1.0]]
    base = torch.tensor([2.0])
    toggled = torch.tensor([[1.9, 2.5, 2.1, 2.2]])  # adding 0 helps, removing 1 hurts a lot
    util = forced_loss_utility(base, toggled, topk)
    assert util[0].tolist() == pytest.approx([0.1, 0.5, 0.1, -0.2])


def test_mismatched_layers_rejected():
    with pytest.raises(ValueError, match="different layers"):
        alignment_report({0: torch.rand(3, 4)}, {1: torch.rand(3, 4)})
    with pytest.raises(ValueError, match="token counts"):
        alignment_report({0: torch.rand(3, 4), 1: torch.rand(5, 4)},
                         {0: torch.rand(3, 4), 1: torch.rand(5, 4)})
    assert not math.isnan(alignment_report({0: torch.rand(3, 4)}, {0: torch.rand(3, 4)},
                                           resamples=0).layers[0].pooled)
