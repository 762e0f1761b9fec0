"""Multi-Router scores, selection and gates against hand-computed cases and Megatron's own
sigmoid top-k routing (seed 000, Eq. 2-3)."""
import math

import pytest
import torch

from megatron_mvmoe.routing import (
    gates, multi_router_logits, select_topk, sigmoid_scores, sum_over_routers, to_megatron)


def _logits_as_weights(logits_RE):
    """hidden = (1, 0) and weight[r, e] = (logit, 0) makes logits_TRE == logits_RE."""
    weight_RED = torch.stack([logits_RE, torch.zeros_like(logits_RE)], dim=-1)
    return torch.tensor([[1.0, 0.0]]), weight_RED


def test_one_gemm_matches_per_head_linears():
    torch.manual_seed(0)
    hidden_TD, weight_RED = torch.randn(5, 6), torch.randn(3, 4, 6)
    logits_TRE = multi_router_logits(hidden_TD, weight_RED)
    for r in range(3):
        torch.testing.assert_close(logits_TRE[:, r], hidden_TD @ weight_RED[r].t())


def test_post_sigmoid_sum_selects_differently_from_summed_logits():
    # head 0 strongly likes expert 0, head 1 mildly prefers expert 1
    hidden_TD, weight_RED = _logits_as_weights(torch.tensor([[6.0, 0.0], [-2.0, 1.0]]))
    logits_TRE = multi_router_logits(hidden_TD, weight_RED)
    summed_TE = sum_over_routers(sigmoid_scores(logits_TRE))
    # hand: sigmoid(6)+sigmoid(-2) = 1.1167 < sigmoid(0)+sigmoid(1) = 1.2311
    expected = [1 / (1 + math.exp(-6)) + 1 / (1 + math.exp(2)), 0.5 + 1 / (1 + math.exp(-1))]
    torch.testing.assert_close(summed_TE[0], torch.tensor(expected))
    assert select_topk(summed_TE, None, 1).item() == 1
    # summing logits first is one linear scorer: logits (4, 1) pick expert 0
    assert select_topk(logits_TRE.sum(dim=1), None, 1).item() == 0


def test_bias_changes_selection_never_gate_values():
    summed_TE = torch.tensor([[0.9, 0.8, 0.7]])
    idx_plain = select_topk(summed_TE, torch.zeros(3), 2)
    idx_biased = select_topk(summed_TE, torch.tensor([0.0, 0.0, 0.3]), 2)
    assert idx_plain.tolist() == [[0, 1]] and idx_biased.tolist() == [[0, 2]]
    # gates come from the UNBIASED sums: 0.9/1.6 and 0.7/1.6, not (0.9, 1.0)/1.9
    torch.testing.assert_close(
        gates(summed_TE, idx_biased, 1.0, 1e-6), torch.tensor([[0.9 / 1.6, 0.7 / 1.6]]))
    # a bias that keeps the selection keeps the gates bit-identical
    idx_same = select_topk(summed_TE, torch.tensor([0.05, -0.02, 0.0]), 2)
    assert torch.equal(gates(summed_TE, idx_same, 1.0, 1e-6),
                       gates(summed_TE, idx_plain, 1.0, 1e-6))


def test_slots_ascending_and_match_routing_map_order():
    torch.manual_seed(1)
    summed_TE = torch.rand(50, 16)
    idx_TS = select_topk(summed_TE, torch.randn(16) * 0.1, 4)
    assert torch.all(idx_TS[:, 1:] > idx_TS[:, :-1])
    gates_TS = gates(summed_TE, idx_TS, 2.5, 1e-6)
    probs_TE, map_TE = to_megatron(gates_TS, idx_TS, 16)
    assert map_TE.dtype == torch.bool and torch.all(map_TE.sum(1) == 4)
    # slot s of token t is the s-th True of routing_map row t
    assert torch.equal(map_TE.nonzero()[:, 1].view(50, 4), idx_TS)
    assert torch.equal(probs_TE[map_TE].view(50, 4), gates_TS)
    assert torch.all(probs_TE[~map_TE] == 0)
    torch.testing.assert_close(gates_TS.sum(1), torch.full((50,), 2.5))


def test_ties_break_to_lower_expert_id_deterministically():
    summed_TE = torch.tensor([[0.2, 0.5, 0.5, 0.5, 0.1], [0.3, 0.3, 0.3, 0.3, 0.3]])
    assert select_topk(summed_TE, None, 2).tolist() == [[1, 2], [0, 1]]
    # a bias tie between a biased and an unbiased expert: still the lower id
    assert select_topk(torch.tensor([[0.5, 0.4]]), torch.tensor([0.0, 0.1]), 1).tolist() == [[0]]
    many_TE = torch.randint(0, 3, (500, 32)).float()  # massive ties
    first = select_topk(many_TE, None, 6)
    assert all(torch.equal(first, select_topk(many_TE, None, 6)) for _ in range(3))
    ref = torch.stack([torch.tensor(sorted(sorted(range(32), key=lambda e: (-row[e], e))[:6]))
                       for row in many_TE.tolist()])
    assert torch.equal(first, ref)


def test_per_expert_alpha_and_eps_floor():
    summed_TE = torch.tensor([[0.6, 0.2, 0.2]])
    idx_TS = torch.tensor([[0, 2]])
    alpha_E = torch.tensor([2.0, 3.0, 4.0])
    torch.testing.assert_close(gates(summed_TE, idx_TS, alpha_E, 1e-6),
                               torch.tensor([[2.0 * 0.75, 4.0 * 0.25]]))
    # tiny scores: the floor keeps gates small instead of renormalising them to alpha
    tiny_TE = torch.full((1, 3), 1e-9)
    assert gates(tiny_TE, idx_TS, 1.0, 1e-6).sum().item() == pytest.approx(2e-3, rel=1e-5)


def test_k1_gate_is_mean_head_score():
    summed_TE = torch.tensor([[1.2, 0.4]])
    idx_TS = select_topk(summed_TE, None, 1)
    torch.testing.assert_close(gates(summed_TE, idx_TS, 1.5, 1e-6, num_routers=2),
                               torch.tensor([[1.5 * 0.6]]))


@pytest.mark.parametrize("topk", [1, 2, 4])
def test_r1_equals_megatron_sigmoid_topk(topk):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function
    torch.manual_seed(2)
    hidden_TD, weight_ED = torch.randn(64, 16), torch.randn(8, 16)
    bias_E, alpha = torch.randn(8) * 0.1, 2.5
    ref_probs, ref_map = topk_routing_with_score_function(
        hidden_TD @ weight_ED.t(), topk, scaling_factor=alpha, score_function="sigmoid",
        expert_bias=bias_E)
    summed_TE = sum_over_routers(sigmoid_scores(multi_router_logits(hidden_TD, weight_ED[None])))
    idx_TS = select_topk(summed_TE, bias_E, topk)
    probs_TE, map_TE = to_megatron(gates(summed_TE, idx_TS, alpha, 1e-6), idx_TS, 8)
    assert torch.equal(map_TE, ref_map)
    torch.testing.assert_close(probs_TE, ref_probs, atol=1e-6, rtol=1e-6)
