"""Warm start from a baseline latent-MoE state dict, and bad configs refused at start-up
with the field named."""

import pytest
import torch

from megatron_mvmoe.config.transformer_config import MultiViewConfig
from megatron_mvmoe.models.warm_start import warm_start_multi_view, warm_start_state_dict
from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import build_layer, global_input, global_weights, load_global_weights, mv_config


def _warm_worker(rank, world_size):
    pgs = initialize_layout(ParallelLayout())
    x = global_input(32)
    results = {}
    for num_routers in (1, 2):
        base_cfg = mv_config("latent", num_routers=1)
        baseline = build_layer(base_cfg, pgs)
        load_global_weights(baseline, global_weights(base_cfg))
        base_out = baseline(x)[0].detach()
        mv = build_layer(mv_config("multi_view", num_routers=num_routers, ramp_steps=100), pgs)
        mv.advance_gamma(50)  # warm start must restart the ramp
        report = warm_start_multi_view(mv, baseline.state_dict())
        mv_out = mv(x)[0].detach()
        mr = build_layer(mv_config("multi_router", num_routers=num_routers), pgs)
        mr.load_state_dict({k: v for k, v in mv.state_dict().items()
                            if k in mr.state_dict()})
        results[num_routers] = {
            "base": base_out, "mv": mv_out, "mr": mr(x)[0].detach(), "gamma": mv.gamma(),
            "head0": torch.equal(mv.router.weight[:8], baseline.router.weight),
            "fresh": not torch.equal(mv.router.weight[8:16], mv.router.weight[:8])
            if num_routers > 1 else True,
            "P": torch.equal(mv.fc1_latent_proj.weight, baseline.fc1_latent_proj.weight),
            "router_head0": report.router_head0, "kept": report.kept}
    return results


def test_warm_start_maps_baseline_and_first_forward_is_exact():
    results = run_distributed(_warm_worker, 1)[0]
    one = results[1]
    # R = K = 1 against Megatron's TopKRouter baseline: equal up to the gate normaliser's
    # summation order (TopKRouter sums the k scores in descending order, MultiRouter in
    # ascending expert order: one ulp); against a Multi-Router baseline it is bit for bit.
    torch.testing.assert_close(one["mv"], one["base"], atol=1e-6, rtol=0)
    for r in (1, 2):
        res = results[r]
        assert res["gamma"] == 0.0 and res["head0"] and res["P"] and res["fresh"]
        assert torch.equal(res["mv"], res["mr"])  # views inert at gamma = 0
    assert results[2]["router_head0"] == ["router.weight"]
    assert "fc1_latent_proj.view_perturbations" in results[2]["kept"]


def _copy_worker(rank, world_size):
    pgs = initialize_layout(ParallelLayout())
    x = global_input(32)
    results = {}
    for topk, num_routers in ((3, 2), (1, 2), (3, 3)):
        base_cfg = mv_config("latent", num_routers=1, moe_router_topk=topk)
        baseline = build_layer(base_cfg, pgs)
        load_global_weights(baseline, global_weights(base_cfg))  # non-zero expert bias
        r1_cfg = mv_config("multi_router", num_routers=1, moe_router_topk=topk)
        r1 = build_layer(r1_cfg, pgs)  # the same baseline on our R = 1 router
        r1.load_state_dict(baseline.state_dict())
        mv = build_layer(mv_config("multi_view", num_routers=num_routers, ramp_steps=4,
                                   moe_router_topk=topk), pgs)
        report = warm_start_multi_view(mv, baseline.state_dict(), new_heads="copy")
        first = mv(x)[0].detach()
        mv.advance_gamma(4)  # gamma = 1: the views now tell the heads apart
        out, _ = mv(x)
        out.sum().backward()
        grad_ED = mv.router.weight.grad.view(num_routers, 8, -1)
        results[(topk, num_routers)] = {
            "base": baseline(x)[0].detach(), "r1": r1(x)[0].detach(), "first": first,
            "bias": torch.equal(mv.router.expert_bias,
                                baseline.router.expert_bias * num_routers),
            "heads_equal": all(torch.equal(h, baseline.router.weight)
                               for h in mv.router.weight.detach().view(num_routers, 8, -1)),
            "grads_differ": not torch.allclose(grad_ED[0], grad_ED[1]),
            "scaled": report.scaled_bias}
    mr = build_layer(mv_config("multi_router", num_routers=2), pgs)
    try:
        warm_start_multi_view(mr, baseline.state_dict(), new_heads="copy")
        results["multi_router"] = None
    except ValueError as exc:
        results["multi_router"] = str(exc)
    return results


def test_copied_heads_reproduce_the_baseline_then_diverge():
    results = run_distributed(_copy_worker, 1)[0]
    for (topk, num_routers), res in ((k, v) for k, v in results.items() if k != "multi_router"):
        case = f"k={topk} R={num_routers}"
        assert res["bias"] and res["heads_equal"], case
        assert res["scaled"] == ["router.expert_bias"], case
        # Not bitwise at layer level: the [R*E, D] logits GEMM rounds differently from the
        # baseline's [E, D] one (BLAS blocking, ~1e-6 in the logits); the routing maths on
        # equal logits is bit for bit (next test). TopKRouter also sums in another order.
        for ref in ("base", "r1"):
            torch.testing.assert_close(res["first"], res[ref], atol=2e-6, rtol=0, msg=case)
        assert res["grads_differ"], case
    refused = results["multi_router"]
    assert refused is not None and refused.startswith("new_heads") and "fresh" in refused


@pytest.mark.parametrize("topk", [1, 3])
def test_copied_heads_route_bit_for_bit_like_the_baseline(topk):
    """R = 2 copies of a head with bias x 2: same selection, gates and 1/2 mixing, bitwise."""
    from megatron_mvmoe.routing import gates, select_topk, sigmoid_scores, sum_over_routers
    from megatron_mvmoe.views import mixing_weights

    gen = torch.Generator().manual_seed(0)
    logits_TE, bias_E = torch.randn(64, 8, generator=gen), torch.randn(8, generator=gen) * 0.1
    one_TE = sum_over_routers(sigmoid_scores(logits_TE.unsqueeze(1)))
    scores_TRE = sigmoid_scores(torch.stack([logits_TE, logits_TE], 1))
    two_TE = sum_over_routers(scores_TRE)
    idx1, idx2 = select_topk(one_TE, bias_E, topk), select_topk(two_TE, 2 * bias_E, topk)
    assert torch.equal(idx1, idx2)
    assert torch.equal(gates(one_TE, idx1, 1.0, 1e-6, 1), gates(two_TE, idx2, 1.0, 1e-6, 2))
    assert torch.equal(mixing_weights(scores_TRE, idx2), torch.full((64, topk, 2), 0.5))


def test_warm_start_refuses_mismatched_baseline():
    target = {"router.weight": torch.zeros(16, 32), "fc1_latent_proj.weight": torch.zeros(8, 32)}
    with pytest.raises(ValueError, match="fc1_latent_proj.weight"):
        warm_start_state_dict({"router.weight": torch.zeros(8, 32),
                               "fc1_latent_proj.weight": torch.zeros(16, 32)}, target)
    with pytest.raises(ValueError, match="fc1_latent_proj.weight: missing"):
        warm_start_state_dict({"router.weight": torch.zeros(8, 32)}, target)
    with pytest.raises(ValueError, match="new_heads"):
        warm_start_state_dict({}, {}, new_heads="clone")


# ---- bad configs fail at start-up, naming the field -----------------------------------------
@pytest.mark.parametrize("overrides,field", [
    (dict(multi_view=MultiViewConfig(num_routers=2, num_views=3)), "multi_view.num_views"),
    (dict(moe_router_topk=9), "moe_router_topk"),
    (dict(expert_model_parallel_size=3), "num_moe_experts"),
    (dict(latent_size=0), "latent_size"),
    (dict(latent_size=-4), "latent_size"),
    (dict(multi_view=MultiViewConfig(num_routers=2, num_views=2, gamma_ramp_steps=-1)),
     "multi_view.gamma_ramp_steps"),
])
def test_bad_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        mv_config("multi_view", **overrides)


@pytest.mark.parametrize("dispatcher", ["allgather", "flex"])
def test_multi_view_refuses_unique_token_dispatchers(dispatcher):
    # refused by the config at start-up, and by its validation when the field is switched
    # after init (what models/provider.fields_config runs; the block spec validates nothing
    # twice)
    with pytest.raises(ValueError, match="moe_token_dispatcher_type") as info:
        mv_config("multi_view", moe_token_dispatcher_type=dispatcher)
    assert "alltoall" in str(info.value) and "top-k" in str(info.value)
    config = mv_config("multi_view")
    config.moe_token_dispatcher_type = dispatcher  # bypassing __post_init__
    with pytest.raises(ValueError, match="moe_token_dispatcher_type"):
        config.validate_mvmoe()
    mv_config("multi_router", num_routers=2,
              moe_token_dispatcher_type=dispatcher)  # fine without views
