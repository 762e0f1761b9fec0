"""Node-limited routing (moe_router_num_groups = nodes, moe_router_group_topk) and the a2a
model, at EP = 4 with 2 ranks per node (2 nodes of 4 experts), top-3:

- every token's experts lie in at most group_topk nodes (Megatron's TopKRouter for the
  latent baseline, the MultiRouter on summed scores otherwise);
- Megatron's alltoall rows are unchanged: T*k per rank, counted == analytic;
- the network hop of the "node" dedup semantic (one copy per (token, destination node))
  carries exactly `node_hop_rows` rows per rank with group_topk = 1 (one node per token:
  T shared rows; Multi-View's K views, cheaper than its k blends here), and within the
  model's bounds with group_topk = 2.
"""

import pytest
import torch

from megatron_mvmoe.analysis.a2a.analytic import (CommShape, dispatch_bytes,
                                                  node_copies_per_token, node_hop_rows)
from megatron_mvmoe.analysis.a2a.counter import count_collectives
from megatron_mvmoe.layers.dedup_dispatcher import DedupAlltoAllTokenDispatcher
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import BATCH, LATENT_VARIANTS, SEQ, ep_layer, global_input, init_ep_layout

EP, RANKS_PER_NODE, NODES, EXPERTS, TOPK, LATENT = 4, 2, 2, 8, 3, 16


def _tokens_records(counter, phase):
    return [r for r in counter.records if r.phase == phase and r.direction == "fwd"
            and r.payload == "tokens" and r.op == "all_to_all_single"]


def _worker(rank, world_size, group_topk):
    pgs = init_ep_layout(world_size)
    results = {}
    for variant in LATENT_VARIANTS:
        config, layer = ep_layer(variant, pgs, world_size, moe_router_num_groups=NODES,
                                 moe_router_group_topk=group_topk)
        x = global_input(config.hidden_size, seed=7 + rank)
        for semantics in ("row", "node"):
            if semantics == "node":
                layer.token_dispatcher = DedupAlltoAllTokenDispatcher(
                    layer.num_local_experts, layer.local_expert_indices, config, pgs,
                    semantics="node", ranks_per_node=RANKS_PER_NODE)
            with count_collectives(layer) as counter:
                out, _ = layer(x.clone().requires_grad_(True))
                out.sum().backward()
            hops = [r.input_bytes for r in _tokens_records(counter, "token_dispatch")]
            results[(variant, semantics)] = {
                "hops": hops, "map": layer.token_dispatcher.routing_map.clone()}
    return results


@pytest.fixture(scope="module", params=[1, 2], ids=["group_topk1", "group_topk2"])
def counted(request):
    return request.param, run_distributed(_worker, EP, timeout_s=240, args=(request.param,))


def _shape(group_topk):
    return CommShape(tokens=SEQ * BATCH, hidden=32, topk=TOPK, latent=LATENT, dtype_bytes=4,
                     ep=EP, experts=EXPERTS, nodes=NODES, group_topk=group_topk)


def test_tokens_reach_at_most_group_topk_nodes(counted):
    group_topk, ranks = counted
    per_node = EXPERTS // NODES
    for result in ranks:
        for variant in LATENT_VARIANTS:
            map_TE = result[(variant, "row")]["map"]
            nodes_T = map_TE.view(-1, NODES, per_node).any(-1).sum(-1)
            assert (nodes_T <= group_topk).all() and (map_TE.sum(1) == TOPK).all(), variant
            if group_topk == 2:
                assert (nodes_T == 2).any(), variant  # the bound is reached


def test_alltoall_rows_unchanged_and_node_hop_equals_the_model(counted):
    group_topk, ranks = counted
    shape = _shape(group_topk)
    row_bytes = LATENT * 4
    assert node_copies_per_token(shape) == ((1, 1) if group_topk == 1 else (1, 2))
    for result in ranks:
        for variant in LATENT_VARIANTS:
            (row_hop,) = result[(variant, "row")]["hops"]
            assert row_hop == dispatch_bytes(variant, "alltoall", shape).tokens_in, variant
            network_hop, _ = result[(variant, "node")]["hops"]
            views = 2 if variant == "multi_view" else 1
            fewest, most = node_hop_rows(shape, views=views)
            assert fewest * row_bytes <= network_hop <= most * row_bytes, variant
            if group_topk == 1:
                assert network_hop == fewest * row_bytes, variant  # exact: one node a token
    if group_topk == 1:  # Multi-View: K = 2 views beat k = 3 blends for one node
        assert node_hop_rows(shape, views=2) == (2 * SEQ * BATCH, 2 * SEQ * BATCH)


def test_node_limit_that_cannot_hold_top_k_is_refused():
    shape = CommShape(tokens=4, hidden=8, topk=5, latent=4, experts=8, nodes=2, group_topk=1)
    with pytest.raises(ValueError, match="group_topk"):
        node_copies_per_token(shape)
