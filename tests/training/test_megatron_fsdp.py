"""Megatron-LM's --use-megatron-fsdp (optimizer.megatron_fsdp): Megatron-Core's Megatron-FSDP
wraps the model on gloo (platform/megatron_fsdp_cpu.py) and trains to the losses of DDP with
the distributed optimizer; its sharding strategies as Megatron-LM spells them; the one not
run here (the 'optim' strategy) refused in one line naming the field and the fix (its
checkpoints: test_fsdp_checkpoint.py)."""

import copy

import pytest

from harness import tiny_run

from megatron_mvmoe.config.flags import config_from_args
from megatron_mvmoe.testing.spawn import run_distributed


STRATEGIES = ("optim_grads_params", "optim_grads", "no_shard")


def _losses_per_wrapper(rank, world_size, raw):
    """DDP's losses, then Megatron-FSDP's under each strategy, in one pair of processes (one
    start-up instead of four)."""
    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training.pretrain import pretrain

    pgs = initialize_layout(config_from_dict(copy.deepcopy(raw)).parallel.layout(), timeout_s=60)
    runs = [{}] + [dict(megatron_fsdp=True, data_parallel_sharding_strategy=s)
                   for s in STRATEGIES]
    results = []
    for optimizer in runs:
        run = copy.deepcopy(raw)
        run["optimizer"].update(optimizer)
        wrappers = set()
        losses = pretrain(config_from_dict(run), pgs,
                          on_step=lambda step, trainer: wrappers.update(
                              type(chunk).__name__ for chunk in trainer.model)).losses
        results.append((sorted(wrappers), losses))
    return results


def test_fsdp_trains_to_ddp_losses(text_tokens):
    raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=3, eval_iters=0)
    raw["optimizer"]["use_distributed_optimizer"] = True
    (ddp_wrapper, ddp), *fsdp = run_distributed(_losses_per_wrapper, 2, timeout_s=240,
                                                 args=(raw,))[0]
    assert ddp_wrapper == ["DistributedDataParallel"]
    for strategy, (wrapper, losses) in zip(STRATEGIES, fsdp):
        assert wrapper == ["FullyShardedDataParallel"], (strategy, wrapper)
        assert len(losses) == 3 and max(abs(a - b) for a, b in zip(ddp, losses)) < 1e-5, \
            (strategy, ddp, losses)


LINE = ["--model-preset", "tiny_smoe", "--use-megatron-fsdp"]


def test_megatron_lm_spellings_reach_the_config():
    o = config_from_args(LINE + ["--data-parallel-sharding-strategy",
                                 "optim_grads_params"]).optimizer
    assert o.megatron_fsdp and o.data_parallel_sharding_strategy == "optim_grads_params"


def test_a_strategy_not_run_here_is_refused_in_one_line():
    with pytest.raises(ValueError) as err:
        config_from_args(LINE + ["--data-parallel-sharding-strategy", "optim"]).validate()
    assert str(err.value).startswith("optimizer.data_parallel_sharding_strategy: optim ")
    assert "Fix: --data-parallel-sharding-strategy optim_grads_params" in str(err.value)
    assert "\n" not in str(err.value)
