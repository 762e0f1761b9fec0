"""Layout parity of the Multi-View layer inside a GPTModel built from our decoder-block spec
and run through Megatron's schedule: EP=2, TP=2 x EP=2 (ETP=1, sequence parallel, 4 ranks) and
PP=2 (1F1B) give the single-rank loss and gradients within 1e-5."""

import pytest
import torch

from megatron_mvmoe.models.specs import build_decoder_block_spec
from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.testing.gpt_harness import (assert_matches_reference, build_gpt,
                                                global_batch, train_step_losses_and_grads)
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import mv_config

VOCAB, SEQ, BATCH, MICRO = 64, 8, 4, 1


def _step(rank, world_size, tp, pp, ep):
    pgs = initialize_layout(ParallelLayout(tp=tp, pp=pp, ep=ep))
    config = mv_config("multi_view", num_routers=2, num_layers=2,
                       tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
                       sequence_parallel=tp > 1,
                       pipeline_dtype=torch.float32, moe_layer_freq=[1, 1])
    spec = build_decoder_block_spec(config)
    model = build_gpt(config, spec, VOCAB, SEQ, pgs)
    return train_step_losses_and_grads(model, config, global_batch(BATCH, SEQ, VOCAB), MICRO, pgs)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_step, 1, args=(1, 1, 1))[0]


@pytest.mark.parametrize("world_size,tp,pp,ep", [(2, 1, 1, 2), (4, 2, 1, 2), (2, 1, 2, 1)],
                         ids=["ep2", "tp2_sp_ep2", "pp2"])
def test_multi_view_layout_matches_single_rank(reference, world_size, tp, pp, ep):
    results = run_distributed(_step, world_size, args=(tp, pp, ep))
    assert_matches_reference(results, reference)
    assert any("view_perturbations" in name for r in results for name in r["grads"])
