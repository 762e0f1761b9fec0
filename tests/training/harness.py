"""Run `pretrain` in-process on gloo ranks (megatron_mvmoe.testing.spawn) with tiny configs
on the real-text token set of textdata.py."""

from __future__ import annotations

import copy
from typing import Dict, Optional

from megatron_mvmoe.testing.spawn import run_distributed
from megatron_mvmoe.training.config import config_from_dict


def tiny_run(data_dir: str, preset: str = "tiny_multi_view", parallel: Optional[Dict] = None,
             **training) -> Dict:
    """A raw run config: vocab 512 (textdata), seq 32, global batch 8, no logging files."""
    base = dict(train_iters=10, global_batch_size=8, micro_batch_size=2, eval_interval=0,
                eval_iters=2, seed=1234)
    base.update(training)
    return dict(model=dict(preset=preset, vocab_size=512, seq_length=32, gamma_ramp_steps=5),
                parallel=dict(parallel or {}, distributed_timeout_seconds=60),
                data=dict(kind="tokens", path=data_dir),
                optimizer=dict(lr=3e-3, min_lr=3e-4, warmup_iters=2),
                training=base, logging=dict(log_interval=5, tensorboard=False))


def _train(rank, world_size, raw, corrupt_at_step):
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training.pretrain import pretrain

    run = config_from_dict(copy.deepcopy(raw))
    pgs = initialize_layout(run.parallel.layout())
    on_step = None
    if corrupt_at_step is not None:
        def on_step(step, trainer):
            if step == corrupt_at_step:  # poison layer 2's attention output projection
                for name, param in trainer.unwrapped()[-1].named_parameters():
                    if "layers.1.self_attention.linear_proj" in name:
                        param.data.fill_(float("inf"))
    result = pretrain(run, pgs, on_step=on_step)
    return {"losses": result.losses, "eval": result.eval, "first_step": result.first_step}


def train(raw: Dict, world_size: int, corrupt_at_step: Optional[int] = None,
          timeout_s: float = 240) -> Dict:
    """Rank 0's RunResult fields (every rank sees the same losses)."""
    # daemon=False: Megatron's checkpoint writer starts helper processes of its own
    # (pretrain() stops them before returning).
    return run_distributed(_train, world_size, timeout_s=timeout_s,
                           args=(raw, corrupt_at_step), daemon=False)[0]
