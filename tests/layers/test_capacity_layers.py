"""Expert capacity / token dropping through the latent, Multi-Router and Multi-View layers.

- R = K = 1 with moe_expert_capacity_factor (dropping; dropping + padding to capacity)
  reproduces the latent baseline on Megatron's own TopKRouter and alltoall dispatcher
  capacity paths: same routing map, probs, output and gradients within 1e-6.
- gamma = 0: Multi-View equals Multi-Router exactly with the same capacity settings.
- The Multi-View rule (layers/multi_view_moe.py): the experts see, in Megatron's order, one
  row per pair left in the routing map: the Eq. 4 blend of a kept slot, the backbone view
  P h of a padding pair; a dropped pair contributes nothing. Checked against a naive
  per-(token, expert) loop, with the output of Eq. 5 over the kept pairs.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import (build_layer, global_input, global_weights, load_global_weights,
                         mv_config, named_grads)

DROP = dict(moe_expert_capacity_factor=0.75)
PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)


def _forward_backward(layer, x):
    x = x.clone().requires_grad_(True)
    out, _ = layer(x)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    (out * weight).sum().backward()
    dispatcher = layer.token_dispatcher
    return {"probs": dispatcher.probs.detach(), "map": dispatcher.routing_map.clone(),
            "out": out.detach(), "x_grad": x.grad.detach(), "grads": named_grads(layer)}


def _run(pgs, variant, num_routers, capacity, ramp_steps=0, weights_from=None):
    config = mv_config(variant, num_routers=num_routers, ramp_steps=ramp_steps, **capacity)
    layer = build_layer(config, pgs)
    load_global_weights(layer, global_weights(weights_from or config))
    return _forward_backward(layer, global_input(config.hidden_size))


def _parity_worker(rank, world_size):
    pgs = initialize_layout(ParallelLayout())
    runs = {}
    for name, capacity in (("drop", DROP), ("pad", PAD)):
        for variant in ("latent", "multi_router", "multi_view"):
            runs[(name, variant, 1)] = _run(pgs, variant, 1, capacity)
        weights_config = mv_config("multi_view", num_routers=2)
        runs[(name, "multi_router", 2)] = _run(pgs, "multi_router", 2, capacity,
                                               weights_from=weights_config)
        runs[(name, "multi_view", 2)] = _run(pgs, "multi_view", 2, capacity, ramp_steps=10)
    return runs


@pytest.fixture(scope="module")
def parity_runs():
    return run_distributed(_parity_worker, 1, timeout_s=150)[0]


@pytest.mark.parametrize("capacity", ["drop", "pad"])
def test_r1_with_capacity_reproduces_the_megatron_latent_baseline(parity_runs, capacity):
    base = parity_runs[(capacity, "latent", 1)]
    rows_per_expert = base["map"].sum(0)
    if capacity == "pad":
        assert rows_per_expert.eq(5).all()  # C = ceil(12 * 3 / 8) rows each
    else:
        assert rows_per_expert.sum() < 12 * 3 and rows_per_expert.max() == 4  # dropped
    for variant in ("multi_router", "multi_view"):
        run = parity_runs[(capacity, variant, 1)]
        assert torch.equal(run["map"], base["map"]), variant
        torch.testing.assert_close(run["probs"], base["probs"], atol=1e-6, rtol=0)
        torch.testing.assert_close(run["out"], base["out"], atol=1e-6, rtol=0)
        torch.testing.assert_close(run["x_grad"], base["x_grad"], atol=1e-6, rtol=1e-6)
        for name, grad in base["grads"].items():
            torch.testing.assert_close(run["grads"][name], grad, atol=1e-6, rtol=1e-6,
                                       msg=f"{variant} {name}")


@pytest.mark.parametrize("capacity", ["drop", "pad"])
def test_gamma_zero_multi_view_equals_multi_router_with_capacity(parity_runs, capacity):
    mr, mv = parity_runs[(capacity, "multi_router", 2)], parity_runs[(capacity, "multi_view", 2)]
    assert torch.equal(mv["map"], mr["map"])
    assert torch.equal(mv["out"], mr["out"])
    for name, grad in mr["grads"].items():
        torch.testing.assert_close(mv["grads"][name], grad, atol=1e-6, rtol=1e-6, msg=name)


# ---- which rows the experts see, against a naive per-(token, expert) loop ----------------
def _naive_rows_and_output(weights, config, x_TD, map_TE, probs_TE):
    """Rows in Megatron's order (expert-major, tokens ascending) for the pairs in map_TE:
    the blend of a selected pair, P h for a pair the token did not select; output Eq. 5."""
    R, E, k = config.multi_view.num_routers, config.num_moe_experts, config.moe_router_topk
    scores_TRE = torch.sigmoid(x_TD @ weights["router"].t()).view(-1, R, E)
    backbone_TL = x_TD @ weights["down"].t()
    views = [backbone_TL] + [backbone_TL + x_TD @ weights["dP"][m].t() for m in range(R - 1)]
    rows, out = [], torch.zeros(x_TD.shape[0], config.latent_size)
    for e in range(E):
        for t in map_TE[:, e].nonzero().flatten().tolist():
            chosen = torch.topk(scores_TRE[t].sum(0) + weights["expert_bias"], k).indices
            if e in chosen.tolist():
                a_R = scores_TRE[t, :, e] / scores_TRE[t, :, e].sum()
                row = sum(a_R[m] * views[m][t] for m in range(R))
            else:
                row = backbone_TL[t]
            rows.append(row)
            y = F.gelu(row @ weights["fc1"][e].t()) @ weights["fc2"][e].t()
            out[t] += probs_TE[t, e] * y
    return torch.stack(rows), out @ weights["up"].t()


def _rows_worker(rank, world_size, capacity):
    config = mv_config("multi_view", num_routers=2, **capacity)
    layer = build_layer(config, initialize_layout(ParallelLayout()))
    weights = global_weights(config)
    load_global_weights(layer, weights)
    seen = []
    layer.experts.register_forward_pre_hook(lambda mod, args: seen.append(
        args[0].detach().clone()))
    x = global_input(config.hidden_size)
    out, _ = layer(x)
    map_TE, probs_TE = layer.token_dispatcher.routing_map, layer.token_dispatcher.probs
    rows_ref, out_ref = _naive_rows_and_output(
        weights, config, x.reshape(-1, config.hidden_size), map_TE, probs_TE.detach())
    return seen[0], rows_ref, out.detach(), out_ref.view_as(out), map_TE


@pytest.mark.parametrize("capacity", [DROP, PAD], ids=["drop", "pad"])
def test_experts_see_kept_blends_and_backbone_padding(capacity):
    rows_NL, rows_ref, out, out_ref, map_TE = run_distributed(
        _rows_worker, 1, args=(capacity,))[0]
    assert rows_NL.shape[0] == map_TE.sum() and (map_TE.sum() != 12 * 3)
    torch.testing.assert_close(rows_NL, rows_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["smoe", "latent", "multi_router", "multi_view",
                                     "mh_moe"])
def test_padding_beyond_the_tokens_of_a_rank_is_refused_in_one_line(variant):
    # factor 4 x top-3 > 8 experts: C = ceil(T*3/8 * 4) > T for every T, where Megatron's
    # drop-and-pad permute fails with a reshape error
    from megatron_mvmoe.layers.mh_reference import mh_test_config
    capacity = dict(moe_expert_capacity_factor=4.0, moe_pad_expert_input_to_capacity=True)
    with pytest.raises(ValueError) as err:
        if variant == "mh_moe":
            mh_test_config(experts=8, topk=3, **capacity)
        else:
            mv_config(variant, num_routers=1 if variant in ("smoe", "latent") else 2,
                      **capacity)
    message = str(err.value)
    assert "\n" not in message and message.startswith("moe_expert_capacity_factor: 4.0")
    assert "Fix: a factor <= 2.66667" in message, message
    mv_config(variant if variant != "mh_moe" else "latent", num_routers=1,
              moe_expert_capacity_factor=2.5, moe_pad_expert_input_to_capacity=True)


def _ep_worker(rank, world_size):
    from layer_utils import ep_layer, init_ep_layout
    pgs = init_ep_layout(world_size)
    runs = {}
    for name, capacity in (("drop", DROP), ("pad", PAD)):
        for variant in ("latent", "multi_view"):
            _, layer = ep_layer(variant, pgs, world_size, num_routers=1, **capacity)
            runs[(name, variant)] = _forward_backward(
                layer, global_input(layer.config.hidden_size, seed=7 + rank))
    return runs


def test_r1_multi_view_equals_the_latent_baseline_with_capacity_at_ep2():
    """The per-row dispatcher on Megatron's capacity paths across ranks (4 local experts
    each: the drop-and-pad local sort) matches Megatron's own dispatcher."""
    for runs in run_distributed(_ep_worker, 2, timeout_s=150):
        for capacity in ("drop", "pad"):
            base, mv = runs[(capacity, "latent")], runs[(capacity, "multi_view")]
            assert torch.equal(mv["map"], base["map"]), capacity
            torch.testing.assert_close(mv["out"], base["out"], atol=1e-6, rtol=0)
            torch.testing.assert_close(mv["x_grad"], base["x_grad"], atol=1e-6, rtol=1e-6)
            for name, grad in base["grads"].items():
                torch.testing.assert_close(mv["grads"][name], grad, atol=1e-6, rtol=1e-6,
                                           msg=f"{capacity} {name}")
