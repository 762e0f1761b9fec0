"""Megatron-LM's --use-tp-pp-dp-mapping (parallel.rank_order): Megatron-Core's `order` with
data-parallel replicas outermost, so consecutive ranks hold consecutive pipeline stages of one
replica; the default keeps the stages outermost. Two functional-test lines of the corpus use
it (tests/training/test_megatron_lm_corpus.py)."""

from megatron_mvmoe.config.flags import config_from_args
from megatron_mvmoe.testing.spawn import run_distributed


def _stage_and_replica(rank, world_size, order):
    from megatron.core import parallel_state

    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout

    initialize_layout(ParallelLayout(pp=2, rank_order=order))
    return (parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_data_parallel_rank())


def test_the_flag_puts_data_parallel_replicas_outermost():
    line = ["--model-preset", "tiny_smoe", "--pipeline-model-parallel-size", "2"]
    assert config_from_args(line).parallel.rank_order == "tp-cp-ep-dp-pp"
    order = config_from_args(line + ["--use-tp-pp-dp-mapping"]).parallel.rank_order
    assert order == "tp-cp-ep-pp-dp"
    # (pipeline stage, data-parallel replica) of global ranks 0..3 at PP 2 x DP 2
    assert run_distributed(_stage_and_replica, 4, args=("tp-cp-ep-dp-pp",)) == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert run_distributed(_stage_and_replica, 4, args=(order,)) == \
        [(0, 0), (1, 0), (0, 1), (1, 1)]
