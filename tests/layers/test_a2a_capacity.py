"""Bytes counted at the EP all-to-all with the expert capacity equal the analytic model
(analysis/a2a/analytic.py) exactly, for the latent baseline, Multi-Router and Multi-View:

- padded to capacity: every rank sends and receives exactly C*E rows (padding included)
  in all four collectives (dispatch and combine, forward and backward), whatever the routing;
- dropping without padding: a rank sends the rows left in its routing map (`kept_rows`),
  fewer than T*k, and the group receives what it sent;
- C is Megatron's get_capacity; MH-MoE counts its T*H sub-tokens (rows of D/H).
"""

import math

import pytest
import torch

from megatron_mvmoe.analysis.a2a.analytic import (CommShape, dispatch_bytes, expert_capacity,
                                                  layer_bytes_per_step)
from megatron_mvmoe.analysis.a2a.counter import count_collectives
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import BATCH, LATENT_VARIANTS, SEQ, ep_layer, global_input, init_ep_layout

DROP = dict(moe_expert_capacity_factor=0.75)
PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
KEYS = (("token_dispatch", "fwd"), ("token_combine", "fwd"), ("token_dispatch", "bwd"),
        ("token_combine", "bwd"))


def _count_worker(rank, world_size, capacity):
    pgs = init_ep_layout(world_size)
    results = {}
    for variant in LATENT_VARIANTS:
        config, layer = ep_layer(variant, pgs, world_size, **capacity)
        x = global_input(config.hidden_size, seed=7 + rank).requires_grad_(True)
        with count_collectives(layer) as counter:
            out, _ = layer(x)
            out.sum().backward()
        a2a = {(phase, d): b for (_, phase, d), b in counter.layer_bytes().items()}
        results[variant] = {"a2a": a2a, "kept": int(layer.token_dispatcher.routing_map.sum())}
    return results


def _shape(config_like, **capacity):
    return CommShape(tokens=SEQ * BATCH, hidden=32, topk=3, latent=16, dtype_bytes=4, ep=2,
                     experts=8, capacity_factor=capacity["moe_expert_capacity_factor"],
                     pad_to_capacity=capacity.get("moe_pad_expert_input_to_capacity", False),
                     **config_like)


def test_capacity_is_megatrons_get_capacity():
    from megatron.core.transformer.moe.moe_utils import get_capacity
    for tokens, factor in ((12, 1.0), (12, 0.75), (4096, 1.25), (7, 0.1)):
        shape = CommShape(tokens=tokens, hidden=8, topk=3, latent=4, experts=8,
                          capacity_factor=factor)
        assert expert_capacity(tokens, shape) == get_capacity(tokens * 3, 8, factor)


def test_padded_to_capacity_every_collective_carries_c_times_e_rows():
    ranks = run_distributed(_count_worker, 2, timeout_s=150, args=(PAD,))
    shape = _shape({}, **PAD)
    volume = dispatch_bytes("multi_view", "alltoall", shape)
    capacity = math.ceil(12 * 3 / 8 * 1.0)
    assert volume.rows == capacity * 8 == 40 and volume.tokens_in == 40 * 16 * 4
    per_step = layer_bytes_per_step("multi_view", "alltoall", shape)
    expected = dict(zip(KEYS, (per_step["dispatch_fwd"], per_step["combine_fwd"],
                               per_step["dispatch_bwd"], per_step["combine_bwd"])))
    for rank_result in ranks:
        for variant in LATENT_VARIANTS:
            assert rank_result[variant]["a2a"] == expected, variant
            assert rank_result[variant]["kept"] == 40


def test_dropped_rows_are_the_kept_rows_of_the_map():
    ranks = run_distributed(_count_worker, 2, timeout_s=150, args=(DROP,))
    for variant in LATENT_VARIANTS:
        sent = []
        for rank_result in ranks:
            kept = rank_result[variant]["kept"]
            assert kept < 12 * 3, variant  # the capacity really dropped rows here
            volume = dispatch_bytes(variant, "alltoall", _shape({"kept_rows": kept}, **DROP))
            a2a = rank_result[variant]["a2a"]
            assert a2a[("token_dispatch", "fwd")] == volume.tokens_in == kept * 16 * 4
            assert a2a[("token_combine", "bwd")] == volume.tokens_in
            sent.append(volume.tokens_in)
        for key in (("token_combine", "fwd"), ("token_dispatch", "bwd")):
            assert sum(r[variant]["a2a"][key] for r in ranks) == sum(sent), (variant, key)
    bound = dispatch_bytes("latent", "alltoall", _shape({}, **DROP))
    assert bound.note.startswith("at most") and bound.rows == min(36, 4 * 8)  # C = 4
    assert all(r[v]["kept"] <= bound.rows for r in ranks for v in LATENT_VARIANTS)


@pytest.mark.parametrize("bad, field_name", [
    (dict(experts=0, capacity_factor=1.0), "experts"),
])
def test_capacity_without_experts_is_refused(bad, field_name):
    with pytest.raises(ValueError, match=field_name):
        dispatch_bytes("latent", "alltoall", CommShape(tokens=4, hidden=8, topk=2, latent=4,
                                                       **bad))


def _mh_worker(rank, world_size, capacity):
    from megatron_mvmoe.layers.builders import build
    from megatron_mvmoe.layers.mh_reference import mh_test_config
    from megatron_mvmoe.layers.multi_head_moe import mh_moe_spec
    pgs = init_ep_layout(world_size)
    config = mh_test_config(heads=2, topk=2, experts=4, hidden=8, ffn=6,
                            expert_model_parallel_size=world_size, **capacity)
    layer = build(mh_moe_spec(config), config=config, pg_collection=pgs)
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(5 + rank))
    with count_collectives(layer) as counter:
        out, _ = layer(x.requires_grad_(True))
        out.sum().backward()
    a2a = {(phase, d): b for (_, phase, d), b in counter.layer_bytes().items()}
    return a2a, int(layer.moe.token_dispatcher.routing_map.sum())


@pytest.mark.parametrize("capacity", [DROP, PAD], ids=["drop", "pad"])
def test_mh_moe_capacity_counts_sub_tokens(capacity):
    """MH-MoE routes T*H sub-tokens with Megatron's TopKRouter: C = ceil(T*H*k/E * factor)
    sub-token rows of D/H per expert."""
    shape = CommShape(tokens=8, hidden=8, topk=2, heads=2, dtype_bytes=4, ep=2, experts=4,
                      capacity_factor=capacity["moe_expert_capacity_factor"],
                      pad_to_capacity=capacity.get("moe_pad_expert_input_to_capacity", False))
    for a2a, kept in run_distributed(_mh_worker, 2, timeout_s=150, args=(capacity,)):
        if capacity is PAD:
            volume = dispatch_bytes("mh_moe", "alltoall", shape)
            assert volume.rows == math.ceil(8 * 2 * 2 / 4) * 4 == kept
            assert set(a2a.values()) == {volume.tokens_in} and len(a2a) == 4
        else:
            assert kept < 8 * 2 * 2
            volume = dispatch_bytes("mh_moe", "alltoall", CommShape(
                **{**shape.__dict__, "kept_rows": kept}))
            assert a2a[("token_dispatch", "fwd")] == volume.tokens_in == kept * 4 * 4
