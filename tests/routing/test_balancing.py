"""Expert-bias rule and aux losses: hand cases and Megatron's formulas on the same inputs."""
import math

import pytest
import torch

from megatron_mvmoe.routing import (
    expert_bias_update, load_balancing_loss, normalized_summed_scores,
    sequence_load_balancing_loss, z_loss)


def test_bias_update_sign_rule_and_centering():
    counts_E, bias_E = torch.tensor([10.0, 2.0, 6.0]), torch.tensor([0.1, 0.0, -0.1])
    torch.testing.assert_close(expert_bias_update(counts_E, bias_E, 0.01),
                               torch.tensor([0.09, 0.01, -0.1]))
    centred2 = expert_bias_update(counts_E, torch.ones(3), 0.01, center=True)
    torch.testing.assert_close(centred2, torch.tensor([-0.01, 0.01, 0.0]))


def test_balanced_load_gives_coeff():
    num_tokens, num_experts, topk = 12, 4, 2
    probs_TE = torch.full((num_tokens, num_experts), 1 / num_experts)
    counts_E = torch.full((num_experts,), num_tokens * topk / num_experts)
    loss = load_balancing_loss(probs_TE, counts_E, num_tokens, topk, coeff=0.01)
    assert loss.item() == pytest.approx(0.01)


def test_matches_megatron_switch_loss_on_normalised_sums():
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func
    torch.manual_seed(0)
    probs_TE = normalized_summed_scores(torch.rand(20, 6) * 2)
    torch.testing.assert_close(probs_TE.sum(-1), torch.ones(20))
    counts_E = torch.randint(0, 10, (6,)).float()
    ref = switch_load_balancing_loss_func(probs_TE, counts_E, 20, 2, 6, 0.03)
    torch.testing.assert_close(load_balancing_loss(probs_TE, counts_E, 20, 2, 0.03), ref)


def test_sequence_loss_matches_megatron_reshape_trick():
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func
    torch.manual_seed(1)
    seq, batch, num_experts, topk = 5, 3, 4, 2
    probs_TE = torch.rand(seq * batch, num_experts)
    map_TE = torch.zeros(seq * batch, num_experts, dtype=torch.bool)
    map_TE.scatter_(1, torch.rand(seq * batch, num_experts).topk(topk, 1).indices, True)
    # Megatron: [S*B, E] -> [S, B*E], counts per (sequence, expert), divide by B
    ref = switch_load_balancing_loss_func(
        probs_TE.reshape(seq, -1), map_TE.reshape(seq, -1).sum(0).float(), seq, topk,
        num_experts, 0.1) / batch
    counts_BE = map_TE.view(seq, batch, num_experts).sum(0).float()
    torch.testing.assert_close(
        sequence_load_balancing_loss(probs_TE, counts_BE, seq, batch, topk, 0.1), ref)


def test_z_loss_hand_case_and_megatron():
    from megatron.core.transformer.moe.moe_utils import z_loss_func
    assert z_loss(torch.zeros(3, 2, 4), 0.5).item() == pytest.approx(0.5 * math.log(4) ** 2)
    logits_TE = torch.randn(7, 5)
    torch.testing.assert_close(z_loss(logits_TE[:, None], 0.2), z_loss_func(logits_TE, 0.2))


def test_z_loss_padding_matches_megatron():
    from megatron.core.transformer.moe.moe_utils import z_loss_func
    logits_TE = torch.randn(6, 5)
    padding_T = torch.tensor([False, True, False, False, True, False])
    torch.testing.assert_close(z_loss(logits_TE[:, None], 0.2, valid_T=~padding_T),
                               z_loss_func(logits_TE, 0.2, padding_mask=padding_T))
