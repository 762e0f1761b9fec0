"""MultiRouter in one process (no process groups): outputs fit together, aux losses fire once,
bias counting, fp32 buffers, config refusals."""
import pytest
import torch

from megatron_mvmoe.config.transformer_config import MultiViewConfig, MVMoETransformerConfig
from megatron_mvmoe.routing import (MultiRouter, load_balancing_loss, multi_router_logits,
                                    normalized_summed_scores, sigmoid_scores, sum_over_routers,
                                    z_loss)
from megatron_mvmoe.views import mixing_weights

E, D = 6, 8


def _config(num_routers=2, num_views=2, **overrides):
    base = dict(
        num_layers=1, hidden_size=D, num_attention_heads=2, num_moe_experts=E, moe_router_topk=2,
        moe_variant="multi_view" if num_views > 1 else "multi_router", latent_size=4,
        multi_view=MultiViewConfig(num_routers=num_routers, num_views=num_views),
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        use_cpu_initialization=True, add_bias_linear=False)
    base.update(overrides)
    return MVMoETransformerConfig(**base)


def test_route_outputs_fit_together():
    torch.manual_seed(0)
    router = MultiRouter(_config())
    assert router.weight.shape == (2 * E, D) and router.expert_bias.shape == (E,)
    with torch.no_grad():
        router.expert_bias.copy_(torch.randn(E) * 0.1)
    hidden_SBD = torch.randn(4, 3, D)
    out = router.route(hidden_SBD)
    assert out.logits_TRE.shape == (12, 2, E) and out.mix_TSR.shape == (12, 2, 2)
    torch.testing.assert_close(out.logits_TRE[:, 1],
                               hidden_SBD.reshape(12, D) @ router.weight[E:].t())
    assert torch.equal(out.routing_map_TE.nonzero()[:, 1].view(12, 2), out.topk_idx_TS)
    assert torch.equal(out.probs_TE[out.routing_map_TE].view(12, 2), out.gates_TS)
    torch.testing.assert_close(out.mix_TSR, mixing_weights(out.scores_TRE, out.topk_idx_TS))
    probs_TE, map_TE = router(hidden_SBD)  # Megatron contract
    assert torch.equal(probs_TE, out.probs_TE) and torch.equal(map_TE, out.routing_map_TE)
    assert MultiRouter(_config(num_views=1)).route(hidden_SBD).mix_TSR is None


def test_expert_bias_counted_only_with_grad():
    router = MultiRouter(_config())
    hidden_TD = torch.randn(10, D)
    with torch.no_grad():
        router.route(hidden_TD)
    assert router.local_tokens_per_expert.sum() == 0
    padding_T = torch.tensor([False] * 7 + [True] * 3)
    router.route(hidden_TD, padding_mask=padding_T)
    assert router.local_tokens_per_expert.sum() == 7 * 2  # padding excluded
    assert router.local_tokens_per_expert.dtype == torch.float32


def _aux_grad(use):
    torch.manual_seed(1)
    router = MultiRouter(_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01))
    hidden_TD = torch.randn(10, D)
    out = router.route(hidden_TD)
    main = sum((getattr(out, name) * 0).sum() for name in use)  # main-loss grad is zero
    main.backward()
    return router, out, router.weight.grad.clone(), hidden_TD


def test_aux_losses_fire_exactly_once_whichever_output_is_used():
    router, out, via_probs, hidden_TD = _aux_grad(["probs_TE"])
    _, _, via_gates, _ = _aux_grad(["gates_TS"])
    _, _, via_both, _ = _aux_grad(["probs_TE", "gates_TS", "mix_TSR"])
    torch.testing.assert_close(via_gates, via_probs)
    torch.testing.assert_close(via_both, via_probs)
    # reference: d(aux + z)/dW computed from the pure functions
    weight = router.weight.detach().clone().requires_grad_(True)
    logits_TRE = multi_router_logits(hidden_TD, weight.view(2, E, D))
    summed_TE = sum_over_routers(sigmoid_scores(logits_TRE))
    counts_E = out.routing_map_TE.sum(0).float()
    ref = (load_balancing_loss(normalized_summed_scores(summed_TE), counts_E, 10, 2, 0.1)
           + z_loss(logits_TRE, 0.01))
    ref.backward()
    torch.testing.assert_close(via_probs, weight.grad)
    torch.testing.assert_close(out.aux_loss, ref.detach())


def test_no_aux_loss_in_eval():
    router = MultiRouter(_config(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)).eval()
    assert router.route(torch.randn(5, D)).aux_loss is None


def test_learned_alpha_gets_gradient_and_scales_gates():
    config = _config(multi_view=MultiViewConfig(num_routers=2, num_views=2, gate_scale=2.0,
                                                learned_gate_scale=True))
    router = MultiRouter(config)
    assert router.gate_scale.shape == (E,)
    out = router.route(torch.randn(5, D))
    torch.testing.assert_close(out.gates_TS.sum(-1), torch.full((5,), 2.0))
    out.probs_TE.sum().backward()
    assert router.gate_scale.grad is not None and router.gate_scale.grad.abs().sum() > 0


def test_buffers_stay_fp32_under_half_cast_and_in_state_dict():
    router = MultiRouter(_config()).to(torch.bfloat16)
    assert router.expert_bias.dtype == torch.bfloat16
    router.route(torch.randn(5, D, dtype=torch.bfloat16))
    assert router.expert_bias.dtype == torch.float32
    assert router.local_tokens_per_expert.dtype == torch.float32
    assert set(router.state_dict()) == {"weight", "expert_bias"}


@pytest.mark.parametrize("field_name, value", [
    ("moe_router_score_function", "softmax"),
    ("moe_input_jitter_eps", 0.1),
    ("moe_router_topk_scaling_factor", 3.0),
    ("moe_router_load_balancing_type", "sinkhorn"),
])
def test_unsupported_settings_are_refused_by_name(field_name, value):
    overrides = {field_name: value}
    if field_name == "moe_router_score_function":
        overrides["moe_router_enable_expert_bias"] = False
    with pytest.raises(ValueError, match=field_name):
        MultiRouter(_config(**overrides))


@pytest.mark.parametrize("num_views", [1, 2])
def test_fused_routing_kernel_path_equals_torch_path(monkeypatch, num_views):
    """multi_view.kernels='triton' routes through mvmoe_kernels.fused_multi_router (the
    Triton interpreter on CPU) and gives the torch path's selection, gates, mixing weights
    and router-weight gradients."""
    mvmoe_kernels = pytest.importorskip("mvmoe_kernels")
    pytest.importorskip("triton")
    calls = []
    original = mvmoe_kernels.fused_multi_router
    monkeypatch.setattr(mvmoe_kernels, "fused_multi_router",
                        lambda *a, **kw: calls.append(kw["backend"]) or original(*a, **kw))
    hidden_TD = torch.randn(10, D, generator=torch.Generator().manual_seed(1))
    outputs = {}
    for kernels in ("triton", "reference"):
        torch.manual_seed(0)
        router = MultiRouter(_config(num_views=num_views,
                                     multi_view=MultiViewConfig(num_routers=2,
                                                                num_views=num_views,
                                                                kernels=kernels)))
        with torch.no_grad():
            router.expert_bias.copy_(torch.linspace(-0.1, 0.1, E))
        out = router.route(hidden_TD)
        loss = out.gates_TS.square().sum() + (0 if out.mix_TSR is None else
                                             out.mix_TSR[..., 0].sum())
        loss.backward()
        outputs[kernels] = (out, router.weight.grad)
    assert calls == ["triton"]
    fused, ref = outputs["triton"][0], outputs["reference"][0]
    assert torch.equal(fused.topk_idx_TS, ref.topk_idx_TS)
    assert torch.equal(fused.routing_map_TE, ref.routing_map_TE)
    torch.testing.assert_close(fused.gates_TS, ref.gates_TS, atol=1e-6, rtol=0)
    if num_views > 1:
        torch.testing.assert_close(fused.mix_TSR, ref.mix_TSR, atol=1e-6, rtol=0)
    torch.testing.assert_close(outputs["triton"][1], outputs["reference"][1], atol=1e-5,
                               rtol=0)
