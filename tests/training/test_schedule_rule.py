"""Resuming with a changed --train-iters / --lr: Megatron-LM's --override-opt-param-scheduler /
--use-checkpoint-opt-param-scheduler rule, with a warning when the checkpoint's schedule
is kept (unit level on Megatron's real scheduler, and end to end through pretrain)."""

import json
import os
import types

import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_mvmoe.config.run_config import config_from_dict
from megatron_mvmoe.training.schedule_rule import restore_scheduler, scheduler_switches
from harness import tiny_run, train

pytestmark = pytest.mark.timeout(600)


def _scheduler(decay, lr, override=False):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.0)
    return OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=lr, min_lr=lr / 10, lr_warmup_steps=1, lr_decay_steps=decay,
        lr_decay_style="cosine", start_wd=0.1, end_wd=0.1, wd_incr_steps=decay,
        wd_incr_style="constant",
        **scheduler_switches(types.SimpleNamespace(override_opt_param_scheduler=override)))


def _training(override=False, use_checkpoint=False):
    return types.SimpleNamespace(override_opt_param_scheduler=override,
                                 use_checkpoint_opt_param_scheduler=use_checkpoint)


def test_kept_schedule_warns_and_override_applies_the_new_one():
    saved = _scheduler(decay=10, lr=1e-3)
    for _ in range(4):
        saved.step(increment=1)
    state = saved.state_dict()
    kept = _scheduler(decay=20, lr=2e-3)
    line = restore_scheduler(kept, state, _training())
    assert line.startswith("warning: resume keeps the checkpoint's") and "default" in line
    assert "lr_decay_steps: checkpoint 10 vs this run 20" in line and "max_lr" in line
    assert "--override-opt-param-scheduler" in line
    assert kept.lr_decay_steps == 10 and kept.max_lr == 1e-3 and kept.num_steps == 4
    assert kept.get_lr(kept.optimizer.param_groups[0]) == saved.get_lr(
        saved.optimizer.param_groups[0])
    new = _scheduler(decay=20, lr=2e-3, override=True)
    line = restore_scheduler(new, state, _training(override=True))
    assert line.startswith("resume: this run's LR/WD schedule replaces") and "step 4" in line
    assert new.lr_decay_steps == 20 and new.max_lr == 2e-3 and new.num_steps == 4
    same = _scheduler(decay=10, lr=1e-3)
    assert restore_scheduler(same, state, _training(use_checkpoint=True)) is None


def test_a_kept_schedule_reaches_param_groups_that_were_not_restored():
    """A weights-only checkpoint (an HF import) restores no param groups, and Megatron's
    groups carry max_lr / min_lr, read before the scheduler's own: the kept schedule must
    reach them (issue 35: the warning said the checkpoint's max_lr was kept while this
    run's was applied)."""
    saved = _scheduler(decay=10, lr=1e-2)
    for _ in range(4):
        saved.step(increment=1)
    fresh = _scheduler(decay=20, lr=2e-3)
    for group in fresh.optimizer.param_groups:  # as Megatron builds them
        group.update(max_lr=2e-3, min_lr=2e-4)
    line = restore_scheduler(fresh, saved.state_dict(), _training(), fresh_groups=True)
    assert "max_lr: checkpoint 0.01 vs this run 0.002" in line
    group = fresh.optimizer.param_groups[0]
    assert (group["max_lr"], group["min_lr"]) == (1e-2, 1e-3)
    assert group["lr"] == saved.get_lr(saved.optimizer.param_groups[0])


def test_both_flags_are_refused():
    raw = {"training": {"override_opt_param_scheduler": True,
                        "use_checkpoint_opt_param_scheduler": True}}
    with pytest.raises(ValueError, match="pass one of them"):
        config_from_dict(raw).validate()


def _saved_decay(root):
    latest = open(os.path.join(root, "latest")).read().strip()
    with open(os.path.join(root, latest, "run_state.json")) as fh:
        return json.load(fh)["scheduler"]["lr_decay_steps"]


def test_extending_a_run_end_to_end(tmp_path, text_tokens):
    data = text_tokens
    first = str(tmp_path / "first")
    train(tiny_run(data, preset="tiny_latent", train_iters=3, eval_iters=0, save=first), 1)
    for override, expected in ((False, 3), (True, 6)):
        root = str(tmp_path / f"extended_{override}")
        out = train(tiny_run(data, preset="tiny_latent", train_iters=6, eval_iters=0,
                             load=first, save=root, override_opt_param_scheduler=override), 1)
        assert out["first_step"] == 4
        assert _saved_decay(root) == expected  # kept: the first run's decay length
