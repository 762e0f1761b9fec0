"""View mixing (seed 000, Eq. 4-5): hand cases, mixing before the expert, stop-gradient."""
import torch

from megatron_mvmoe.routing import (
    gates, multi_router_logits, select_topk, sigmoid_scores, sum_over_routers)
from megatron_mvmoe.views import mix_views, mixing_weights


def test_mixing_weights_hand_case_and_sum_to_one():
    # Figure 1 of the paper: (0.4, 0.1) and (0.2, 0.3) both sum to 0.5, opposite preferences
    scores_TRE = torch.tensor([[[0.4, 0.2, 0.9], [0.1, 0.3, 0.9]]])  # [T=1, R=2, E=3]
    mix_TSR = mixing_weights(scores_TRE, torch.tensor([[0, 1]]))
    torch.testing.assert_close(mix_TSR, torch.tensor([[[0.8, 0.2], [0.4, 0.6]]]))
    torch.manual_seed(0)
    scores_TRE = torch.rand(30, 3, 8)
    mix_TSR = mixing_weights(scores_TRE, select_topk(scores_TRE.sum(1), None, 3))
    torch.testing.assert_close(mix_TSR.sum(-1), torch.ones(30, 3))


def test_underflowed_scores_fall_back_to_uniform_without_nan():
    scores_TRE = torch.zeros(1, 2, 3, requires_grad=True)
    mix_TSR = mixing_weights(scores_TRE, torch.tensor([[1]]))
    torch.testing.assert_close(mix_TSR, torch.tensor([[[0.5, 0.5]]]))
    mix_TSR.sum().backward()
    assert torch.isfinite(scores_TRE.grad).all()


def test_expert_sees_the_mixed_input_not_mixed_outputs():
    views_TRL = torch.tensor([[[1.0, 2.0], [-1.0, 0.0]]])  # [T=1, R=2, L=2]
    mix_TSR = torch.tensor([[[0.5, 0.5], [0.25, 0.75]]])  # [T=1, S=2, R=2]
    rows_TSL = mix_views(views_TRL, mix_TSR)
    torch.testing.assert_close(rows_TSL, torch.tensor([[[0.0, 1.0], [-0.5, 0.5]]]))

    def expert(x):
        return x.square()  # nonlinear
    mixed_inputs = expert(rows_TSL)                              # E(sum a v)
    mixed_outputs = torch.bmm(mix_TSR, expert(views_TRL))       # sum a E(v)
    torch.testing.assert_close(mixed_inputs, torch.tensor([[[0.0, 1.0], [0.25, 0.25]]]))
    assert not torch.allclose(mixed_inputs, mixed_outputs)


def _router_and_views_grads(stop_grad_mixing, detach_mix_by_hand=False, detach_gates=False):
    torch.manual_seed(3)
    num_tokens, hidden, heads, experts, latent, topk = 6, 5, 2, 4, 3, 2
    hidden_TD = torch.randn(num_tokens, hidden)
    weight_RED = torch.randn(heads, experts, hidden, requires_grad=True)
    views_TRL = torch.randn(num_tokens, heads, latent, requires_grad=True)
    scores_TRE = sigmoid_scores(multi_router_logits(hidden_TD, weight_RED))
    summed_TE = sum_over_routers(scores_TRE)
    idx_TS = select_topk(summed_TE, None, topk)
    gates_TS = gates(summed_TE, idx_TS, 1.0, 1e-6)
    mix_TSR = mixing_weights(scores_TRE, idx_TS)
    if detach_mix_by_hand:
        mix_TSR = mix_TSR.detach()
    if detach_gates:
        gates_TS = gates_TS.detach()
    rows_TSL = mix_views(views_TRL, mix_TSR, stop_grad_mixing)
    out_TL = (gates_TS.unsqueeze(-1) * torch.tanh(rows_TSL * 2.0)).sum(1)
    out_TL.square().sum().backward()
    return weight_RED.grad, views_TRL.grad


def test_stop_grad_removes_exactly_the_mixing_weight_path():
    full_w, full_v = _router_and_views_grads(False)
    stop_w, stop_v = _router_and_views_grads(True)
    ref_w, ref_v = _router_and_views_grads(False, detach_mix_by_hand=True)
    mix_only_w, _ = _router_and_views_grads(False, detach_gates=True)
    torch.testing.assert_close(stop_w, ref_w, rtol=0, atol=0)
    torch.testing.assert_close(stop_v, full_v)  # the views keep their gradient
    assert not torch.allclose(stop_w, full_w)
    # full router gradient = gate path (stop_grad) + mixing path
    torch.testing.assert_close(full_w, stop_w + mix_only_w)
