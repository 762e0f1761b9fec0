"""Run `pretrain` in-process on gloo ranks (megatron_mvmoe.testing.spawn) with tiny configs
on the real-text token set of textdata.py."""

from __future__ import annotations

import copy
from typing import Dict, Optional, Tuple

from megatron_mvmoe.config.run_config import config_from_dict
from megatron_mvmoe.testing.spawn import run_distributed


def tiny_run(data_dir: str, preset: str = "tiny_multi_view", parallel: Optional[Dict] = None,
             **training) -> Dict:
    """A raw run config: vocab 512 (textdata), seq 32, global batch 8, no logging files."""
    base = dict(train_iters=10, global_batch_size=8, micro_batch_size=2, eval_interval=0,
                eval_iters=2, seed=1234)
    base.update(training)
    return dict(model=dict(preset=preset, vocab_size=512, seq_length=32,
                           multi_view=dict(gamma_ramp_steps=5)),
                parallel=dict(parallel or {}, distributed_timeout_seconds=60),
                data=dict(kind="tokens", path=data_dir),
                optimizer=dict(lr=3e-3, min_lr=3e-4, warmup_iters=2),
                training=base, logging=dict(log_interval=5, tensorboard=False))


DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
"""Megatron-LM's default dropout on both streams: hidden dropout draws from the default
generator (with sequence parallelism, from a fork of Megatron's RNG tracker), attention
dropout from the tracker's model-parallel state; a resume must continue both."""


def with_dropout(raw: Dict) -> Dict:
    """`raw` (a tiny_run config) with DROPOUT."""
    raw["model"]["extra"] = dict(DROPOUT)
    return raw


def _nan_loss_once(step_to_poison: int):
    """on_step hook: the model's per-token losses are multiplied by NaN in step
    `step_to_poison` only (the weights stay finite), so that step's loss and grads are NaN."""
    handles = []

    def on_step(step, trainer):
        while handles:
            handles.pop().remove()
        if step == step_to_poison:
            for chunk in trainer.unwrapped():
                handles.append(chunk.register_forward_hook(
                    lambda mod, args, out: out * float("nan") if out is not None else out))
    return on_step


def _signal_at(step_to_signal: int, signum: int, rank: int):
    """on_step hook: `rank` sends itself `signum` at the start of that step."""
    import os

    import torch.distributed as dist

    def on_step(step, trainer):
        if step == step_to_signal and dist.get_rank() == rank:
            os.kill(os.getpid(), signum)
    return on_step


def _corrupt_at(corrupt_at_step: int):
    def on_step(step, trainer):
        if step == corrupt_at_step:  # poison layer 2's attention output projection
            for name, param in trainer.unwrapped()[-1].named_parameters():
                if "layers.1.self_attention.linear_proj" in name:
                    param.data.fill_(float("inf"))
    return on_step


def _desync_at(step_to_desync: int, rank: int):
    """on_step hook: `rank` alone nudges its first weight at the start of that step, so its
    data-parallel replica differs from the others' from then on."""
    import torch.distributed as dist

    def on_step(step, trainer):
        if step == step_to_desync and dist.get_rank() == rank:
            next(trainer.unwrapped()[0].parameters()).data.add_(1e-3)
    return on_step


def _kill_in_publish(kill_at: int):
    """No on_step hook: this rank's checkpoint publish dies as under kill -9 (os._exit(9))
    just before its `kill_at`-th file operation (kill_points.py)."""
    import os

    from kill_points import dying_at
    from megatron_mvmoe.training import checkpoint

    real = checkpoint._publish

    def publish(*args):
        with dying_at(kill_at, lambda: os._exit(9)):
            real(*args)
    checkpoint._publish = publish  # this forked rank only


def _train(rank, world_size, raw, hook):
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training.pretrain import pretrain

    run = config_from_dict(copy.deepcopy(raw))
    pgs = initialize_layout(run.parallel.layout(),
                            timeout_s=run.parallel.distributed_timeout_seconds)
    on_step = None
    if hook is not None:
        on_step = {"corrupt": _corrupt_at, "nan": _nan_loss_once, "signal": _signal_at, "desync": _desync_at,
                   "kill_publish": _kill_in_publish}[hook[0]](*hook[1:])
    result = pretrain(run, pgs, on_step=on_step)
    return {"losses": result.losses, "eval": result.eval, "first_step": result.first_step,
            "stopped": result.stopped, "skipped_iters": result.skipped_iters,
            "last_checkpoint": result.last_checkpoint}


def train(raw: Dict, world_size: int, corrupt_at_step: Optional[int] = None,
          timeout_s: float = 240, hook: Optional[Tuple] = None) -> Dict:
    """Rank 0's RunResult fields (every rank sees the same losses). `hook`: ("nan", step),
    ("signal", step, signum, rank), ("corrupt", step), ("desync", step, rank) or
    ("kill_publish", k), see the
    functions above."""
    # daemon=False: Megatron's checkpoint writer starts helper processes of its own
    # (pretrain() stops them before returning).
    if corrupt_at_step is not None:
        hook = ("corrupt", corrupt_at_step)
    return run_distributed(_train, world_size, timeout_s=timeout_s,
                           args=(raw, hook), daemon=False)[0]
