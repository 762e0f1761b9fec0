"""MultiRouter against Megatron-Core 0.19.2's own TopKRouter (sigmoid + expert bias) at
R = K = 1: probs, routing map, every aux/z loss logged through MoEMetricsTracker and every
gradient, with calculate_per_token_loss off and on, at TP = 1, TP = 2 (SP), CP = 2 and
TP = 2 x CP = 2 (token counts over TP x CP, issue 22), with a
non-zero balancing bias; and the finalize_model_grads expert-bias update finding and moving
our bias like Megatron's.

Megatron runs in forked gloo ranks (megatron_mvmoe.testing.spawn) with the CPU patches.
"""
import pytest
import torch

from megatron_mvmoe.config.transformer_config import MultiViewConfig, MVMoETransformerConfig
from megatron_mvmoe.testing.spawn import run_distributed

HIDDEN, EXPERTS, SEQ, BATCH = 16, 8, 6, 3


def _config(topk=2, alpha=2.5, num_routers=1, **overrides):
    base = dict(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=EXPERTS,
        moe_router_topk=topk, moe_variant="multi_router", latent_size=8,
        multi_view=MultiViewConfig(num_routers=num_routers, num_views=1, gate_scale=alpha),
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=alpha, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        use_cpu_initialization=True, add_bias_linear=False)
    base.update(overrides)
    return MVMoETransformerConfig(**base)


def _randn(*shape, seed):
    # explicit generators: the test never reseeds the global RNG of the patched process
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _pair(config, pg, bias_scale):
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_mvmoe.routing import MultiRouter
    ref, ours = TopKRouter(config, pg), MultiRouter(config, pg)
    with torch.no_grad():
        ours.weight.copy_(ref.weight)
        bias_E = _randn(EXPERTS, seed=0) * bias_scale
        ref.expert_bias.copy_(bias_E)
        ours.expert_bias.copy_(bias_E)
    for router in (ref, ours):
        router.set_layer_number(1)
    return ref, ours


def _run_and_grads(router, hidden_SBD, upstream_TE):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    hidden_SBD = hidden_SBD.clone().requires_grad_(True)
    probs_TE, map_TE = router(hidden_SBD)
    (probs_TE * upstream_TE).sum().backward()
    logged = {name: (entry.values.clone(), entry.reduce_group, entry.avg_group,
                     entry.needs_dp_avg) for name, entry in tracker.metrics.items()}
    return probs_TE.detach(), map_TE, router.weight.grad.clone(), hidden_SBD.grad, logged


def _parity_rank(rank, world_size, topk, bias_scale, overrides, layout=None):
    from megatron_mvmoe.parallel import ParallelLayout, destroy_layout, initialize_layout
    destroy_layout()
    pg = initialize_layout(ParallelLayout(**(layout or {})))
    config = _config(topk=topk, **overrides)
    ref, ours = _pair(config, pg, bias_scale)
    # SP / CP: each TP and each CP rank has its own tokens
    hidden_SBD = _randn(SEQ, BATCH, HIDDEN, seed=1 + rank)
    upstream_TE = _randn(SEQ * BATCH, EXPERTS, seed=2)
    r_probs, r_map, r_wgrad, r_hgrad, r_log = _run_and_grads(ref, hidden_SBD, upstream_TE)
    o_probs, o_map, o_wgrad, o_hgrad, o_log = _run_and_grads(ours, hidden_SBD, upstream_TE)
    assert torch.equal(r_map, o_map)
    assert (r_map.sum(1) == topk).all()
    torch.testing.assert_close(o_probs, r_probs, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(o_wgrad, r_wgrad, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(o_hgrad, r_hgrad, atol=1e-6, rtol=1e-6)
    assert r_log.keys() == o_log.keys()
    for name, (r_values, *r_groups) in r_log.items():
        o_values, *o_groups = o_log[name]
        torch.testing.assert_close(o_values, r_values, atol=1e-6, rtol=1e-6)
        assert o_groups == r_groups, name  # same reduction groups and DP averaging
    torch.testing.assert_close(ours.local_tokens_per_expert, ref.local_tokens_per_expert)
    return sorted(r_log)


def _parity_cases_rank(rank, world_size, cases):
    return [_parity_rank(rank, world_size, *case) for case in cases]


ALL_LOSSES = dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss", "global_aux_loss"],
                  moe_aux_loss_coeff=[0.01, 0.02, 0.03], moe_z_loss_coeff=1e-3)
LOGGED = ["global_load_balancing_loss", "load_balancing_loss", "seq_load_balancing_loss",
          "z_loss"]


def test_r1_matches_megatron_topk_router_with_bias_and_losses():
    # the bias is non-zero with the losses on: both take the aux-loss map without it
    cases = [(1, 0.05, {}), (2, 0.05, {}), (3, 0.05, {}),
             (2, 0.5, ALL_LOSSES), (2, 0.5, dict(ALL_LOSSES, calculate_per_token_loss=True))]
    logged = run_distributed(_parity_cases_rank, 1, timeout_s=150, args=(cases,))[0]
    assert logged[:3] == [[], [], []]
    assert logged[3] == logged[4] == LOGGED


def test_r1_losses_match_megatron_with_counts_reduced_over_tp():
    tp2 = dict(ALL_LOSSES, tensor_model_parallel_size=2, sequence_parallel=True,
               expert_tensor_parallel_size=1)
    cases = [(2, 0.5, tp2, {"tp": 2}),
             (2, 0.5, dict(tp2, calculate_per_token_loss=True), {"tp": 2})]
    logged = run_distributed(_parity_cases_rank, 2, timeout_s=150, args=(cases,))
    assert logged[0] == [LOGGED, LOGGED]


def _groups_rank(rank, world_size, layout):
    """Sizes of the groups both routers reduce token counts over (aux / global aux)."""
    from megatron_mvmoe.parallel import ParallelLayout, destroy_layout, initialize_layout
    destroy_layout()
    pg = initialize_layout(ParallelLayout(**layout))
    return pg.tp_cp.size(), pg.tp_dp_cp.size()


@pytest.mark.parametrize("layout,world", [({"cp": 2}, 2), ({"tp": 2, "cp": 2}, 4)],
                         ids=["cp2", "tp2_sp_cp2"])
def test_r1_losses_match_megatron_with_counts_reduced_over_tp_cp(layout, world):
    """Under CP the sequence's tokens are split over the CP ranks: the aux losses' token
    counts (and the z-loss and per-token scaling) are taken over TP x CP, as Megatron's
    TopKRouter does, and equal it at R = 1 loss by loss, gradient by gradient."""
    parallel = dict(ALL_LOSSES, context_parallel_size=2,
                    tensor_model_parallel_size=layout.get("tp", 1),
                    sequence_parallel="tp" in layout, expert_tensor_parallel_size=1)
    cases = [(2, 0.5, parallel, layout),
             (2, 0.5, dict(parallel, calculate_per_token_loss=True), layout)]
    logged = run_distributed(_parity_cases_rank, world, timeout_s=150, args=(cases,))
    assert logged == [[LOGGED, LOGGED]] * world
    assert run_distributed(_groups_rank, world, args=(layout,)) == [(world, world)] * world


def _per_token_scaling_rank(rank, world_size):
    """The per-token-loss path multiplies the attached aux loss by local tokens x TP size:
    the router-weight gradient of the losses alone differs by exactly that factor."""
    from megatron_mvmoe.parallel import ParallelLayout, destroy_layout, initialize_layout
    from megatron_mvmoe.routing import MultiRouter
    destroy_layout()
    pg = initialize_layout(ParallelLayout(tp=2))
    grads = []
    for per_token in (False, True):
        config = _config(topk=2, tensor_model_parallel_size=2, sequence_parallel=True,
                         expert_tensor_parallel_size=1, calculate_per_token_loss=per_token,
                         moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01)
        torch.manual_seed(0)
        router = MultiRouter(config, pg)
        router.set_layer_number(1)
        probs_TE, _ = router(_randn(SEQ, BATCH, HIDDEN, seed=1 + rank))
        (probs_TE * 0).sum().backward()  # only the attached aux loss has a gradient
        grads.append(router.weight.grad.clone())
    torch.testing.assert_close(grads[1], grads[0] * SEQ * BATCH * 2, rtol=1e-5, atol=1e-9)
    return float(grads[0].abs().sum())


def test_per_token_loss_scales_aux_gradient_by_local_tokens_times_tp():
    sums = run_distributed(_per_token_scaling_rank, 2, timeout_s=150)
    assert all(s > 0 for s in sums)


def _bias_update_rank(rank, world_size):
    from megatron.core.distributed.finalize_model_grads import (
        _update_router_expert_bias, reset_model_temporary_tensors)

    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
    from megatron_mvmoe.routing import expert_bias_update
    pg = initialize_layout(ParallelLayout())  # world 2: DP = 2, counts all-reduced
    config = _config(moe_router_bias_update_rate=0.01)
    ref, ours = _pair(config, pg, 0.05)
    hidden_SBD = _randn(SEQ, BATCH, HIDDEN, seed=10 + rank)  # DP ranks see different tokens
    with torch.no_grad():
        ours(hidden_SBD)  # eval / recompute pass under no_grad: not counted
    assert ours.local_tokens_per_expert.sum() == 0
    for router in (ref, ours):
        router(hidden_SBD)
    local_E = ours.local_tokens_per_expert.clone()
    bias_before = ours.expert_bias.clone()
    model = [torch.nn.ModuleList([ref, ours])]
    _update_router_expert_bias(model, config)
    torch.testing.assert_close(ours.expert_bias, ref.expert_bias, rtol=0, atol=0)
    global_E = local_E.clone()
    torch.distributed.all_reduce(global_E)
    torch.testing.assert_close(ours.expert_bias, expert_bias_update(global_E, bias_before, 0.01))
    assert not torch.equal(ours.expert_bias, bias_before)
    reset_model_temporary_tensors(config, model)
    assert ours.local_tokens_per_expert.sum() == 0
    return ours.expert_bias.tolist()


def test_finalize_model_grads_updates_our_bias_like_megatron():
    biases = run_distributed(_bias_update_rank, 2, timeout_s=180)
    assert biases[0] == biases[1]  # every DP rank applies the same update
