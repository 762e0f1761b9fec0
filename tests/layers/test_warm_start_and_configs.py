"""Warm start from a baseline latent-MoE state dict, and bad configs refused at start-up
with the field named."""

import pytest
import torch

from megatron_mvmoe.config import MultiViewConfig
from megatron_mvmoe.models.specs import build_decoder_block_spec, validate_variant
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


def test_warm_start_refuses_mismatched_baseline():
    target = {"router.weight": torch.zeros(16, 32), "fc1_latent_proj.weight": torch.zeros(8, 32)}
    with pytest.raises(ValueError, match="fc1_latent_proj.weight"):
        warm_start_state_dict({"router.weight": torch.zeros(8, 32),
                               "fc1_latent_proj.weight": torch.zeros(16, 32)}, target)
    with pytest.raises(ValueError, match="fc1_latent_proj.weight: missing"):
        warm_start_state_dict({"router.weight": torch.zeros(8, 32)}, target)


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
    # refused by the config at start-up (and again by the layer's own check)
    with pytest.raises(ValueError, match="moe_token_dispatcher_type") as info:
        mv_config("multi_view", moe_token_dispatcher_type=dispatcher)
    assert "alltoall" in str(info.value) and "top-k" in str(info.value)
    config = mv_config("multi_view")
    config.moe_token_dispatcher_type = dispatcher  # bypassing __post_init__
    with pytest.raises(ValueError, match="moe_token_dispatcher_type"):
        build_decoder_block_spec(config)
    validate_variant(mv_config("multi_router", num_routers=2,
                               moe_token_dispatcher_type=dispatcher))  # fine without views
