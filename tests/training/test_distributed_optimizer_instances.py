"""Megatron-LM's --num-distributed-optimizer-instances (parallel.distributed_optimizer_instances):
at DP 4 two copies of the distributed optimizer, each sharded over 2 ranks, train to the
losses of one copy sharded over 4 (same math, another reduction order); without the
distributed optimizer it is refused naming the fix."""

import pytest

from harness import tiny_run, train

from megatron_mvmoe.config.flags import config_from_args


def test_two_instances_train_as_one(text_tokens):
    def losses(instances):
        raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=3, eval_iters=0)
        raw["parallel"]["distributed_optimizer_instances"] = instances
        raw["optimizer"]["use_distributed_optimizer"] = True
        return train(raw, 4)["losses"]

    one, two = losses(1), losses(2)
    assert len(two) == 3 and max(abs(a - b) for a, b in zip(one, two)) < 1e-5, (one, two)


def test_instances_need_the_distributed_optimizer():
    line = ["--model-preset", "tiny_smoe", "--num-distributed-optimizer-instances", "2"]
    assert config_from_args(line + ["--use-distributed-optimizer"]).parallel.\
        distributed_optimizer_instances == 2
    with pytest.raises(ValueError, match=r"^parallel.distributed_optimizer_instances: .*"
                                         r"--use-distributed-optimizer"):
        config_from_args(line + ["--use-distributed-optimizer", "false"]).validate()


def _intra_and_inter_sizes(rank, world_size):
    from megatron.core import parallel_state

    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout

    initialize_layout(ParallelLayout(distributed_optimizer_instances=2))
    return (parallel_state.get_intra_distributed_optimizer_instance_group().size(),
            parallel_state.get_inter_distributed_optimizer_instance_group().size())


def test_each_instance_shards_over_dp_over_instances_ranks():
    from megatron_mvmoe.testing.spawn import run_distributed

    assert run_distributed(_intra_and_inter_sizes, 4) == [(2, 2)] * 4


def test_instances_must_divide_the_expert_data_parallel_size_too():
    """Megatron-Core splits the expert data-parallel group into the instances as well (an
    assert in initialize_model_parallel on every rank after the launch): TP 2 = ETP 2 x EP 2
    on 4 ranks is DP 2 but expert DP 1, refused at validation naming the field; 8 ranks
    (expert DP 2) pass. Megatron-LM's multi_dist_optimizer_instances line failed on 4 ranks."""
    from megatron_mvmoe.parallel import ParallelLayout

    layout = ParallelLayout(tp=2, ep=2, etp=2, distributed_optimizer_instances=2)
    with pytest.raises(ValueError, match=r"^layout.distributed_optimizer_instances: 2 does not "
                                         r"divide the expert data-parallel size 1"):
        layout.validate(4, num_experts=8)
    layout.validate(8, num_experts=8)


@pytest.mark.parametrize("sizes", [dict(tp=2, ep=2, etp=2), dict(ep=2), dict(tp=2, pp=2, ep=4)])
def test_smallest_world_size_is_one_the_instances_divide(sizes):
    """The planner's and the HF importer's default world (smallest_world_size) must be one
    validate accepts: with 2 instances both the data-parallel and the expert data-parallel
    sizes are multiples of 2 (it returned 4 for TP 2 = ETP 2 x EP 2, which validate refuses)."""
    from megatron_mvmoe.parallel import ParallelLayout

    layout = ParallelLayout(**sizes, distributed_optimizer_instances=2)
    world = layout.smallest_world_size()
    layout.validate(world, num_experts=8)
    for smaller in range(1, world):
        with pytest.raises(ValueError):
            layout.validate(smaller, num_experts=8)
