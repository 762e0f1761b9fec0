"""The collective counter labels the phases each dispatcher class declares: the Triton
path's `dispatch_preprocess_permuted` (its metadata all-gather) is attributed, not lost."""

import importlib.util

import pytest
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron_mvmoe.analysis.a2a.counter import count_collectives, declared_phases
from megatron_mvmoe.layers.dedup_dispatcher import DedupAlltoAllTokenDispatcher
from megatron_mvmoe.layers.per_row_dispatcher import PerRowAlltoAllTokenDispatcher
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import ep_layer, global_input, init_ep_layout


def test_classes_declare_their_phases():
    assert declared_phases(PerRowAlltoAllTokenDispatcher) == (
        "dispatch_preprocess_rows", "dispatch_preprocess_permuted")
    assert "dispatch_preprocess_views" in declared_phases(DedupAlltoAllTokenDispatcher)
    assert declared_phases(MoEAlltoAllTokenDispatcher) == (
        "dispatch_preprocess", "token_dispatch", "dispatch_postprocess", "combine_preprocess",
        "token_combine")


def _triton_worker(rank, world_size):
    config, layer = ep_layer("multi_view", init_ep_layout(world_size), world_size,
                             kernels="triton")
    x = global_input(config.hidden_size, seed=rank).requires_grad_(True)
    with count_collectives(layer) as counter:
        out, _ = layer(x)
        out.sum().backward()
    return [(r.layer, r.phase, r.direction, r.payload) for r in counter.records]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_triton_path_metadata_collective_is_attributed(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # set before triton loads in the child
    for records in run_distributed(_triton_worker, 2, timeout_s=300, start_method="spawn"):
        assert records and all(layer is not None for layer, *_ in records), records
        assert ("dispatch_preprocess_permuted", "fwd", "metadata") in {
            (phase, direction, payload) for _, phase, direction, payload in records}
