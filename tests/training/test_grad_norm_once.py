"""The trainer computes the gradient norm once per step (training/grad_norm_once.py): the
NaN/inf verdict's norm is the one Megatron-Core's ChainedOptimizer clips with, and the
losses equal those of the two-norm step bit for bit."""

import copy

from harness import tiny_run

from megatron_mvmoe.config.run_config import config_from_dict
from megatron_mvmoe.testing.spawn import run_distributed

STEPS = 3


def _norms_and_losses(rank, world_size, raw):
    """{reuse: (losses, Megatron grad-norm computations)} of two `STEPS`-step runs in this
    spawned rank: the step as it is, and as it was (Megatron's step computes the norm again)."""
    from contextlib import nullcontext

    import megatron.core.optimizer.optimizer as megatron_optimizer

    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training import step
    from megatron_mvmoe.training.pretrain import pretrain

    calls = []
    norm = megatron_optimizer.get_grad_norm_fp32

    def counted(*args, **kwargs):
        calls.append(1)
        return norm(*args, **kwargs)
    megatron_optimizer.get_grad_norm_fp32 = counted  # this spawned rank only
    run = config_from_dict(copy.deepcopy(raw))
    pgs = initialize_layout(run.parallel.layout(),
                            timeout_s=run.parallel.distributed_timeout_seconds)
    out = {}
    for reuse in (True, False):
        if not reuse:
            step.grad_norm_reused = lambda optimizer, value: nullcontext()
        calls.clear()
        out[reuse] = (pretrain(config_from_dict(copy.deepcopy(raw)), pgs).losses, len(calls))
    return out


def test_one_grad_norm_per_step_same_losses(text_tokens):
    raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=STEPS, eval_iters=0)
    raw["optimizer"]["clip_grad"] = 0.05  # below the tiny run's norms: every step clips
    runs = run_distributed(_norms_and_losses, 1, timeout_s=240, args=(raw,), daemon=False)[0]
    (once, once_norms), (twice, twice_norms) = runs[True], runs[False]
    assert twice_norms == 2 * STEPS  # the count is live: the old step computes two
    assert once_norms == STEPS
    assert once == twice
