"""The dispatcher registry (config/dispatchers.py records, layers/dispatchers.py builders):
every dispatcher is listed and built for each variant it supports, an unsupported
(dispatcher, variant / feature) pair fails at config build with one line naming both and the
alternative (the dispatchers' constructors refuse with the very same line: one list), and
Multi-View dispatches through the one per-row contract both dispatchers implement."""

import pytest

from megatron_mvmoe.config.dispatchers import DISPATCHER_NAMES, DISPATCHERS, check_dispatcher
from megatron_mvmoe.config.variants import VARIANTS
from megatron_mvmoe.layers.dedup_dispatcher import DedupAlltoAllTokenDispatcher
from megatron_mvmoe.layers.dispatchers import BUILDERS, install_dispatchers
from megatron_mvmoe.layers.per_row_dispatcher import PerRowAlltoAllTokenDispatcher, PerRowDispatch
from megatron_mvmoe.models.build import validate_run

from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import build_layer, init_ep_layout, mv_config

EXPECTED = {  # written out by hand: the reference the registry is checked against
    "alltoall": {"smoe", "latent", "multi_router", "multi_view", "mh_moe"},
    "dedup_rank": {"smoe", "latent", "multi_router", "multi_view"},
    "dedup_node": {"smoe", "latent", "multi_router", "multi_view"},
}


def _config(variant, dispatcher, **overrides):
    """The launcher's check of a run (models.build.validate_run, errors in run names)."""
    from megatron_mvmoe.toolkit import checkpoint

    run = checkpoint.run_config(f"tiny_{variant}", overrides={
        "model.moe_dispatcher": dispatcher, **overrides})
    return validate_run(run)


def test_registry_lists_every_dispatcher_with_a_builder():
    assert DISPATCHER_NAMES == ("alltoall", "dedup_rank", "dedup_node")
    assert set(BUILDERS) == set(DISPATCHERS)
    assert {name: set(d.variants) for name, d in DISPATCHERS.items()} == EXPECTED
    assert all(set(d.variants) <= set(VARIANTS) for d in DISPATCHERS.values())


@pytest.mark.parametrize("dispatcher, variant", sorted(
    (d, v) for d, variants in EXPECTED.items() for v in variants))
def test_every_supported_pair_builds(dispatcher, variant):
    config = _config(variant, dispatcher)
    assert config.moe_dispatcher == dispatcher


@pytest.mark.parametrize("dispatcher, variant, overrides, names", [
    ("dedup_rank", "mh_moe", {}, ["'dedup_rank'", "moe_variant='mh_moe'", "['alltoall']"]),
    ("dedup_node", "dense", {}, ["'dedup_node'", "moe_variant='dense'", "'alltoall'"]),
    ("dedup_rank", "multi_view", {"model.extra": {"moe_expert_capacity_factor": 1.0}},
     ["'dedup_rank'", "moe_expert_capacity_factor=1.0", "moe_dispatcher='alltoall'"]),
    ("dedup_node", "smoe", {"model.moe_dispatch_ranks_per_node": 3},
     ["'dedup_node'", "moe_dispatch_ranks_per_node=3", "moe_dispatcher='alltoall'"]),
])
def test_unsupported_pair_is_one_line_naming_both(dispatcher, variant, overrides, names):
    with pytest.raises(ValueError) as err:
        _config(variant, dispatcher, **overrides)
    message = str(err.value)
    assert "\n" not in message and message.count("Fix:") == 1, message
    assert message.startswith("model.moe_dispatcher:"), message
    assert all(name in message for name in names), message


@pytest.mark.parametrize("cls, dispatcher, field, value", [
    (PerRowAlltoAllTokenDispatcher, "alltoall", "moe_permute_fusion", True),
    (PerRowAlltoAllTokenDispatcher, "alltoall", "moe_router_padding_for_quantization", True),
    (DedupAlltoAllTokenDispatcher, "dedup_rank", "moe_expert_capacity_factor", 1.0),
    (DedupAlltoAllTokenDispatcher, "dedup_rank", "expert_tensor_parallel_size", 2),
])
def test_constructors_refuse_with_the_records_line(cls, dispatcher, field, value):
    """The refusals are written once (config/dispatchers.py): a dispatcher built outside a
    run config refuses with the line the config check gives (refused before any group)."""
    config = mv_config(moe_dispatcher=dispatcher)
    setattr(config, field, value)  # after the config's own checks, as code could
    with pytest.raises(ValueError) as built:
        cls(1, [0], config)
    with pytest.raises(ValueError) as loaded:
        check_dispatcher(config)
    assert str(built.value) == str(loaded.value) and f"{field}=" in str(built.value)
    assert issubclass(cls, PerRowDispatch)  # the contract the Multi-View layer calls


def test_flags_select_the_dispatcher():
    from megatron_mvmoe.config.flags import config_from_args

    run = config_from_args(["--model-preset", "tiny_multi_view", "--moe-dispatcher",
                            "dedup_node", "--moe-dispatch-ranks-per-node", "1"])
    config = validate_run(run)
    assert (config.moe_dispatcher, config.moe_dispatch_ranks_per_node) == ("dedup_node", 1)


def test_unknown_dispatcher_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"moe_dispatcher.*dedup_rank"):
        _config("multi_view", "dedup")


def _install_worker(rank, world_size):
    pgs = init_ep_layout(world_size)
    built = {}
    for dispatcher in DISPATCHER_NAMES:
        config = mv_config(moe_dispatcher=dispatcher, moe_dispatch_ranks_per_node=1,
                           expert_model_parallel_size=world_size)
        layer = build_layer(config, pgs)
        changed = install_dispatchers(layer, config)
        d = layer.token_dispatcher
        built[dispatcher] = (changed, type(d), d.multi_view_input,
                             getattr(d, "semantics", None), d.ep_group is pgs.ep)
    return built


def test_install_builds_the_selected_dispatcher_on_the_layers_groups():
    expected = {"alltoall": (0, PerRowAlltoAllTokenDispatcher, "rows", None, True),
                "dedup_rank": (1, DedupAlltoAllTokenDispatcher, "views", "rank", True),
                "dedup_node": (1, DedupAlltoAllTokenDispatcher, "views", "node", True)}
    for built in run_distributed(_install_worker, 2):
        assert built == expected
