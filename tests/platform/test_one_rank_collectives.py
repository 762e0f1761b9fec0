"""platform/one_rank_collectives.py: at a group of one rank the distributed optimizer's grad
reduce-scatter and param all-gather are the identity, so the patch skips them (gloo cloned
the whole grad buffer for them every step) and training is unchanged, bit for bit."""

import pytest
import torch
from harness import tiny_run, train

from megatron_mvmoe.launch.local_ranks import run_distributed
from megatron_mvmoe.platform.cpu_patches import SKIP_ENV

PATCH = "one-rank grad reduce-scatter"


def _collectives_in_a_step(rank, world):
    """The c10d grad reduce-scatters and param all-gathers one training step of a 1-rank tiny smoe run calls."""
    from torch.profiler import ProfilerActivity, profile

    from megatron_mvmoe.training import step_bench as sb

    raw = sb.raw_run("issue", "smoe")
    raw["model"].update(num_layers=1, hidden_size=32, num_attention_heads=2, num_experts=4,
                        moe_ffn_hidden_size=32, ffn_hidden_size=32, vocab_size=256,
                        seq_length=16)
    raw["data"]["null_vocab_size"] = 255  # NullTokenizer: 255 + EOD = vocab_size
    raw["training"].update(micro_batch_size=2, global_batch_size=2)
    run = sb.run_config(raw)
    config, pgs = sb.rank_setup(run)
    step = sb.TrainerStep(run, pgs, config)
    try:
        step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    finally:
        step.close()
    # (the progress line's metrics gather objects every step: other all_gathers)
    return sorted({e.name for e in prof.events() if e.name.startswith("c10d::") and (
        "reduce_scatter" in e.name or "into_tensor" in e.name)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU patch")
def test_one_rank_step_calls_no_grad_or_param_collective():
    assert run_distributed(_collectives_in_a_step, 1, timeout_s=240, daemon=False)[0] == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU patch")
def test_losses_equal_megatrons_own_collectives(text_tokens, monkeypatch):
    raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=3, eval_iters=0,
                   global_batch_size=4)
    patched = train(raw, 1)["losses"]
    monkeypatch.setenv(SKIP_ENV, PATCH)
    assert train(raw, 1)["losses"] == patched
