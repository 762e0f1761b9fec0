"""A small Megatron-Core GPTModel with MoE layers through Megatron's pipeline schedule:
PP=2 (1F1B over 4 microbatches), EP=2 and TP=2 x EP=2 (sequence parallel, ETP=1) give the
single-rank loss and gradients within 1e-5. The stock smoe variant uses Megatron's own
MoELayer; the block spec only swaps the torch norm for an SP-capable one on CPU."""

import pytest
import torch

from megatron_mvmoe.models.specs import build_decoder_block_spec
from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.testing.gpt_harness import (assert_matches_reference, build_gpt,
                                                global_batch, train_step_losses_and_grads)
from megatron_mvmoe.testing.spawn import run_distributed
from megatron_mvmoe.testing.stock_moe import sigmoid_moe_config

VOCAB, SEQ, BATCH, MICRO = 64, 8, 4, 1


def _step(rank, world_size, tp, pp, ep):
    pgs = initialize_layout(ParallelLayout(tp=tp, pp=pp, ep=ep))
    config = sigmoid_moe_config(num_layers=2, tensor_model_parallel_size=tp,
                                expert_tensor_parallel_size=1,
                                pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                                sequence_parallel=tp > 1, pipeline_dtype=torch.float32)
    model = build_gpt(config, build_decoder_block_spec(config), VOCAB, SEQ,
                      pgs)
    return train_step_losses_and_grads(model, config, global_batch(BATCH, SEQ, VOCAB), MICRO, pgs)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_step, 1, args=(1, 1, 1))[0]


@pytest.mark.parametrize("world_size,tp,pp,ep", [(2, 1, 2, 1), (2, 1, 1, 2), (4, 2, 1, 2)])
def test_layout_matches_single_rank(reference, world_size, tp, pp, ep):
    results = run_distributed(_step, world_size, args=(tp, pp, ep))
    assert_matches_reference(results, reference)
