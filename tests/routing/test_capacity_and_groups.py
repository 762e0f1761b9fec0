"""Expert capacity / token dropping and group-limited routing in the MultiRouter.

- R = 1 equals Megatron-Core 0.19.2's TopKRouter (sigmoid + expert bias) with
  moe_expert_capacity_factor (probs and position policies, with and without padding to
  capacity) and with moe_router_num_groups / moe_router_group_topk: same routing map, probs,
  router and input gradients, expert-bias counts and logged aux losses.
- R = 2 against naive references: groups chosen on the summed sigmoid scores + bias (a
  per-token loop), the probs policy keeping each expert's top-C gates (a per-expert loop),
  the position policy's invariants, padding to exactly C rows per expert with gate 0.
"""
import math

import pytest
import torch

from megatron_mvmoe.config.transformer_config import MultiViewConfig, MVMoETransformerConfig
from megatron_mvmoe.routing import MultiRouter
from megatron_mvmoe.testing.spawn import run_distributed

from test_router_megatron import ALL_LOSSES, _config, _pair, _randn, _run_and_grads

E, D, TOKENS = 8, 16, 18


def _parity_rank(rank, world_size, cases):
    from megatron_mvmoe.parallel import ParallelLayout, destroy_layout, initialize_layout
    destroy_layout()
    pg = initialize_layout(ParallelLayout())
    kept_counts = []
    for topk, overrides in cases:
        config = _config(topk=topk, **overrides)
        ref, ours = _pair(config, pg, bias_scale=0.05)
        hidden_SBD = _randn(6, 3, 16, seed=1)
        upstream_TE = _randn(18, 8, seed=2)
        r_probs, r_map, r_wgrad, r_hgrad, r_log = _run_and_grads(ref, hidden_SBD, upstream_TE)
        o_probs, o_map, o_wgrad, o_hgrad, o_log = _run_and_grads(ours, hidden_SBD, upstream_TE)
        assert torch.equal(r_map, o_map), overrides
        torch.testing.assert_close(o_probs, r_probs, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(o_wgrad, r_wgrad, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(o_hgrad, r_hgrad, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ours.local_tokens_per_expert, ref.local_tokens_per_expert)
        assert r_log.keys() == o_log.keys()
        for name, (r_values, *_) in r_log.items():
            torch.testing.assert_close(o_log[name][0], r_values, atol=1e-6, rtol=1e-6)
        kept_counts.append(o_map.sum(0).tolist())
    return kept_counts


CAPACITY_CASES = [
    (2, dict(moe_expert_capacity_factor=1.0)),
    (2, dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position")),
    (3, dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)),
    (2, dict(ALL_LOSSES, moe_expert_capacity_factor=0.75)),
    (2, dict(moe_router_num_groups=4, moe_router_group_topk=2)),
    (4, dict(moe_router_num_groups=2, moe_router_group_topk=1)),
    (2, dict(ALL_LOSSES, moe_router_num_groups=4, moe_router_group_topk=1,
             moe_expert_capacity_factor=1.0)),
]


def test_r1_capacity_and_group_limited_routing_match_megatron_topk_router():
    kept = run_distributed(_parity_rank, 1, timeout_s=150, args=(CAPACITY_CASES,))[0]
    capacity = math.ceil(18 * 2 / 8 * 1.0)
    assert max(kept[0]) == capacity and sum(kept[0]) < 18 * 2  # something really dropped
    assert max(kept[1]) <= math.ceil(18 * 2 / 8 * 0.5) and sum(kept[1]) < 18 * 2
    assert kept[2] == [math.ceil(18 * 3 / 8)] * 8  # padded: C rows per expert
    assert sum(kept[4]) == 18 * 2 and sum(kept[5]) == 18 * 4  # groups alone drop nothing


# ---- R = 2 against naive references ------------------------------------------------------
def _router(topk=2, num_routers=2, seed=0, **overrides):
    config = MVMoETransformerConfig(
        num_layers=1, hidden_size=D, num_attention_heads=2, num_moe_experts=E,
        moe_router_topk=topk, moe_variant="multi_view", latent_size=4,
        multi_view=MultiViewConfig(num_routers=num_routers, num_views=num_routers,
                                   gate_scale=1.5),
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        use_cpu_initialization=True, add_bias_linear=False, **overrides)
    torch.manual_seed(seed)
    router = MultiRouter(config)
    with torch.no_grad():
        router.weight.normal_(0, 0.7)
        router.expert_bias.copy_(torch.randn(E) * 0.1)
    return router


def _hidden(seed=1):
    return torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(seed))


def _naive_group_selection(summed_TE, bias_E, topk, num_groups, group_topk):
    per_group = E // num_groups
    chosen = []
    for routing_E in (summed_TE + bias_E).tolist():
        group_scores = [sum(sorted(routing_E[g * per_group:(g + 1) * per_group],
                                   reverse=True)[:topk // group_topk])
                        for g in range(num_groups)]
        groups = sorted(range(num_groups), key=lambda g: -group_scores[g])[:group_topk]
        allowed = [e for e in range(E) if e // per_group in groups]
        chosen.append(sorted(sorted(allowed, key=lambda e: -routing_E[e])[:topk]))
    return torch.tensor(chosen)


@pytest.mark.parametrize("topk, num_groups, group_topk", [(2, 4, 1), (3, 4, 2), (4, 2, 1)])
def test_groups_are_chosen_on_summed_sigmoid_scores_plus_bias(topk, num_groups, group_topk):
    router = _router(topk, moe_router_num_groups=num_groups, moe_router_group_topk=group_topk)
    plain = _router(topk)
    out, free = router.route(_hidden()), plain.route(_hidden())
    summed_TE = out.scores_TRE.sum(1).detach()
    expected_TS = _naive_group_selection(summed_TE, router.expert_bias, topk, num_groups,
                                         group_topk)
    assert torch.equal(out.topk_idx_TS, expected_TS)
    groups_per_token = [len({e // (E // num_groups) for e in row}) for row in
                        out.topk_idx_TS.tolist()]
    assert max(groups_per_token) <= group_topk
    assert not torch.equal(out.topk_idx_TS, free.topk_idx_TS)  # the limit really bites
    # gates are Eq. 3 over the (group-limited) selection, from the unbiased sums
    selected_TS = summed_TE.gather(1, out.topk_idx_TS)
    torch.testing.assert_close(out.gates_TS.detach(),
                               1.5 * selected_TS / selected_TS.sum(-1, keepdim=True))


def _naive_probs_drop(probs_TE, map_TE, capacity):
    """Each expert keeps its `capacity` largest gates among the tokens that selected it."""
    kept_TE = torch.zeros_like(map_TE)
    for e in range(E):
        tokens = map_TE[:, e].nonzero().flatten().tolist()
        best = sorted(tokens, key=lambda t: -probs_TE[t, e].item())[:capacity]
        kept_TE[best, e] = True
    return kept_TE


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.5])
def test_probs_policy_keeps_each_experts_top_capacity_gates(factor):
    dropless = _router().route(_hidden())
    out = _router(moe_expert_capacity_factor=factor).route(_hidden())
    capacity = math.ceil(TOKENS * 2 / E * factor)
    expected_TE = _naive_probs_drop(dropless.probs_TE.detach(), dropless.routing_map_TE,
                                    capacity)
    assert torch.equal(out.routing_map_TE, expected_TE)
    torch.testing.assert_close(out.probs_TE, dropless.probs_TE * expected_TE)
    assert torch.equal(out.kept_TS, expected_TE.gather(1, out.topk_idx_TS))
    torch.testing.assert_close(out.gates_TS, dropless.gates_TS)  # gates before dropping
    if factor < 1.5:
        assert out.routing_map_TE.sum() < TOKENS * 2  # rows really dropped


def test_position_policy_keeps_capacity_rows_of_the_selection():
    dropless = _router().route(_hidden())
    out = _router(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position").route(
        _hidden())
    capacity = math.ceil(TOKENS * 2 / E * 0.5)
    selected_TE = dropless.routing_map_TE
    assert not (out.routing_map_TE & ~selected_TE).any()  # only selected rows survive
    expected_counts = selected_TE.sum(0).clamp(max=capacity)
    assert torch.equal(out.routing_map_TE.sum(0), expected_counts)
    assert (out.routing_map_TE.sum(0) < selected_TE.sum(0)).any()
    torch.testing.assert_close(out.probs_TE, dropless.probs_TE * out.routing_map_TE)


def test_padding_fills_every_expert_to_capacity_with_zero_gates():
    dropped = _router(moe_expert_capacity_factor=1.0).route(_hidden())
    padded = _router(moe_expert_capacity_factor=1.0,
                     moe_pad_expert_input_to_capacity=True).route(_hidden())
    capacity = math.ceil(TOKENS * 2 / E)
    assert padded.routing_map_TE.sum(0).eq(capacity).all()
    # the selected rows that survive are the same; the padding rows carry gate 0
    selected_TE = torch.zeros_like(padded.routing_map_TE).scatter(1, padded.topk_idx_TS, True)
    assert torch.equal(padded.routing_map_TE & selected_TE, dropped.routing_map_TE)
    padding_TE = padded.routing_map_TE & ~selected_TE
    assert padding_TE.any() and padded.probs_TE[padding_TE].eq(0).all()
    torch.testing.assert_close(padded.probs_TE, dropped.probs_TE)


def test_expert_bias_counts_the_map_after_dropping():
    router = _router(moe_expert_capacity_factor=0.5)
    out = router.route(_hidden())
    assert torch.equal(router.local_tokens_per_expert, out.routing_map_TE.sum(0).float())


@pytest.mark.parametrize("overrides, field_name", [
    (dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=3),
     "moe_router_group_topk"),
])
def test_too_few_experts_in_the_allowed_groups_is_refused(overrides, field_name):
    topk = overrides.pop("moe_router_topk")
    with pytest.raises(ValueError, match=field_name):
        _router(topk, **overrides)


def test_group_limited_routing_selects_on_torch_with_the_triton_backend(monkeypatch):
    """The fused Triton selection has no group mask: with multi_view.kernels='triton' a
    group-limited router never calls it and gives the reference path's routing."""
    mvmoe_kernels = pytest.importorskip("mvmoe_kernels")
    calls = []
    monkeypatch.setattr(mvmoe_kernels, "fused_multi_router",
                        lambda *a, **kw: calls.append(kw) or None)
    groups = dict(moe_router_num_groups=4, moe_router_group_topk=1)
    outputs = {}
    for kernels in ("triton", "reference"):
        router = _router(**groups)
        router.config.multi_view.kernels = kernels
        outputs[kernels] = router.route(_hidden())
    assert calls == []
    fused, ref = outputs["triton"], outputs["reference"]
    assert torch.equal(fused.topk_idx_TS, ref.topk_idx_TS)
    torch.testing.assert_close(fused.gates_TS, ref.gates_TS)
    torch.testing.assert_close(fused.mix_TSR, ref.mix_TSR)
