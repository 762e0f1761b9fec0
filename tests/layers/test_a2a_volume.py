"""Bytes counted at the EP all-to-all (dispatch and combine, forward and backward) are
identical for the latent baseline, Multi-Router and Multi-View at the same tokens, top-k,
latent size and dtype, equal the analytic count, and counting changes no result."""

import pytest
import torch

from megatron_mvmoe.analysis.a2a.analytic import CommShape, dispatch_bytes, group_total_bytes
from megatron_mvmoe.analysis.a2a.counter import count_collectives
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import BATCH, LATENT_VARIANTS, SEQ, ep_layer, global_input, \
    init_ep_layout, mv_config


def _count_worker(rank, world_size):
    pgs = init_ep_layout(world_size)
    results = {}
    for variant in LATENT_VARIANTS:
        config, layer = ep_layer(variant, pgs, world_size)
        x = global_input(config.hidden_size)
        plain, _ = layer(x)
        with count_collectives(layer) as counter:
            x_grad = x.clone().requires_grad_(True)
            out, _ = layer(x_grad)
            out.sum().backward()
        results[variant] = {"a2a": counter.layer_bytes(), "records": counter.records,
                            "same": torch.equal(out.detach(), plain.detach())}
    return results


@pytest.mark.parametrize("ep", [2, 4])
def test_a2a_bytes_equal_across_variants_and_analytic(ep):
    ranks = run_distributed(_count_worker, ep)
    config = mv_config("latent", num_routers=1)
    shape = CommShape(tokens=SEQ * BATCH,
                      hidden=config.hidden_size, topk=config.moe_router_topk,
                      latent=config.latent_size, dtype_bytes=4, ep=ep)
    per_rank = dispatch_bytes("multi_view", "alltoall", shape).tokens_in
    assert per_rank == 12 * 3 * 16 * 4
    deterministic = (("token_dispatch", "fwd"), ("token_combine", "bwd"))
    for rank_result in ranks:
        by_variant = {v: {(phase, d): b for (_, phase, d), b in rank_result[v]["a2a"].items()}
                      for v in LATENT_VARIANTS}
        for variant, a2a in by_variant.items():
            assert rank_result[variant]["same"], f"{variant}: counting changed the output"
            assert set(a2a) == {("token_dispatch", "fwd"), ("token_combine", "fwd"),
                                ("token_dispatch", "bwd"), ("token_combine", "bwd")}, variant
            for key in deterministic:  # what a rank sends: T*k rows of L, whatever the routing
                assert a2a[key] == per_rank, (variant, key)
        # same router weights -> same routing: Multi-View moves exactly Multi-Router's bytes
        assert by_variant["multi_view"] == by_variant["multi_router"]
    # what a rank receives depends on the routing; over the EP group it sums to EP*T*k rows
    group_total = group_total_bytes("multi_view", "alltoall", shape)
    for key in (("token_combine", "fwd"), ("token_dispatch", "bwd")) + deterministic:
        for variant in LATENT_VARIANTS:
            summed = sum(b for r in ranks for (_, phase, d), b in r[variant]["a2a"].items()
                         if (phase, d) == key)
            assert summed == group_total, (variant, key)
