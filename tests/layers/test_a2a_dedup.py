"""The dedup dispatcher (per destination rank, per destination node) gives the alltoall
path's outputs and gradients within 1e-5, and the bytes counted at torch.distributed equal
the analytic dispatch-semantics bytes exactly, per rank, phase, direction, payload and link,
for Megatron's alltoall rows and both dedup semantics, at EP = 2 and 4 (2 ranks per node):
the int64 bookkeeping ("metadata": split counts, expert ids, (n, mode) pairs, Megatron's
tokens-per-expert all-gather) included."""

import pytest
import torch

from megatron_mvmoe.analysis.a2a.counter import count_collectives
from megatron_mvmoe.a2a_model.semantics import link_bytes, payload_for_variant
from megatron_mvmoe.a2a_model.placement import EpPlacement
from megatron_mvmoe.analysis.a2a.volume import peer_counts, semantic_checks
from megatron_mvmoe.layers.dedup_dispatcher import DedupAlltoAllTokenDispatcher
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import LATENT_VARIANTS, ep_layer, global_input, init_ep_layout, \
    mv_config, named_grads

SEMANTICS = ("row", "rank", "node")
RANKS_PER_NODE = 2


def _run(layer, x, loss_weights):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    with count_collectives(layer) as counter:
        y, _ = layer(x)
        (y * loss_weights).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad.detach(), "grads": named_grads(layer),
            "peers": peer_counts(counter.records),
            "routing": layer.token_dispatcher.routing_map.clone()}


def _worker(rank, world_size):
    pgs = init_ep_layout(world_size)
    results = {}
    for variant in LATENT_VARIANTS:
        config, layer = ep_layer(variant, pgs, world_size)
        x = global_input(config.hidden_size, seed=7 + rank)  # each rank routes differently
        loss_weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
        alltoall = layer.token_dispatcher
        for semantics in SEMANTICS:
            layer.token_dispatcher = alltoall if semantics == "row" else \
                DedupAlltoAllTokenDispatcher(
                    layer.num_local_experts, layer.local_expert_indices, config, pgs,
                    semantics=semantics, ranks_per_node=RANKS_PER_NODE)
            results[(variant, semantics)] = _run(layer, x, loss_weights)
        layer.token_dispatcher = alltoall
    return results


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    return request.param, run_distributed(_worker, request.param)


def test_dedup_equals_alltoall_outputs_and_gradients(ranks):
    _, per_rank = ranks
    for result in per_rank:
        for variant in LATENT_VARIANTS:
            ref = result[(variant, "row")]
            for semantics in ("rank", "node"):
                got = result[(variant, semantics)]
                torch.testing.assert_close(got["y"], ref["y"], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(got["x_grad"], ref["x_grad"], atol=1e-5, rtol=1e-5)
                assert set(got["grads"]) == set(ref["grads"]), (variant, semantics)
                for name, grad in ref["grads"].items():
                    torch.testing.assert_close(got["grads"][name], grad, atol=1e-5, rtol=1e-5,
                                               msg=f"{variant} {semantics} {name}")


def test_counted_equals_analytic_for_every_semantic(ranks):
    ep, per_rank = ranks
    config = mv_config("multi_view", num_routers=2)
    placement = EpPlacement(ep, RANKS_PER_NODE, config.num_moe_experts)
    views_used = False
    for variant in LATENT_VARIANTS:
        shape = payload_for_variant(variant, config.hidden_size, config.latent_size,
                                    views=1 if variant == "latent" else 2, dtype_bytes=4)
        for semantics in SEMANTICS:
            maps = torch.stack([r[(variant, semantics)]["routing"] for r in per_rank])
            analytic = link_bytes(maps, placement, shape, semantics)
            (layer,) = per_rank[0][(variant, semantics)]["peers"]
            counted = [r[(variant, semantics)]["peers"][layer] for r in per_rank]
            found = semantic_checks(analytic, placement, counted, layer)
            bad = [c.as_dict() for c in found if not c.ok]
            assert found and not bad, (variant, semantics, bad[:4])
            assert {k for c in counted for k in c} == set(analytic), (variant, semantics)
            assert any(payload == "metadata" for _, _, payload in analytic), semantics
            if variant == "multi_view" and semantics == "rank":
                base = link_bytes(maps, placement, payload_for_variant(
                    "latent", config.hidden_size, config.latent_size, dtype_bytes=4), "rank")
                key = ("token_dispatch", "fwd", "tokens")
                views_used = bool((analytic[key] < base[key] * 3).any()) and not torch.equal(
                    analytic[key], base[key])
    assert views_used, "the test routing never made K views cheaper than the blends"
