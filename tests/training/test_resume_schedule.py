"""Resuming with another --lr / --min-lr / --weight-decay / warmup / decay length (issue 25
finding 2): the optimizer state loads (Megatron 0.19's param-group keys include max_lr and
min_lr, so this raised KeyError / ValueError before resume_groups.py), and every param group
then runs the schedule the rule picks: this run's with --override-opt-param-scheduler, the
checkpoint's otherwise. Checked against a naive re-statement of the warmup + cosine rule.
Also Megatron-LM's --no-load-optim (step and data position kept) and --finetune."""

import copy
import math

import pytest

from harness import tiny_run, train

pytestmark = pytest.mark.timeout(600)

SAVED_AT = 3
BASE = dict(lr=3e-3, min_lr=3e-4, warmup_iters=2, decay_iters=8, weight_decay=0.1)
CHANGES = {"lr": dict(lr=1e-3), "min_lr": dict(min_lr=1e-5), "weight_decay":
           dict(weight_decay=0.02), "warmup": dict(warmup_iters=1), "decay":
           dict(decay_iters=20)}
RULES = {"override": dict(override_opt_param_scheduler=True),
         "checkpoint": dict(use_checkpoint_opt_param_scheduler=True), "neither": {}}


def naive_lr(o, step):
    """Linear warmup from 0, then cosine to min_lr (Megatron's OptimizerParamScheduler)."""
    if o["warmup_iters"] > 0 and step <= o["warmup_iters"]:
        return o["lr"] * step / o["warmup_iters"]
    if step > o["decay_iters"]:
        return o["min_lr"]
    ratio = (step - o["warmup_iters"]) / (o["decay_iters"] - o["warmup_iters"])
    return o["min_lr"] + 0.5 * (math.cos(math.pi * ratio) + 1) * (o["lr"] - o["min_lr"])


def _raw(text_tokens, parallel, optimizer, **training):
    raw = tiny_run(text_tokens, preset="tiny_latent", parallel=parallel, eval_iters=0, **training)
    raw["optimizer"].update(optimizer)
    return raw


def _resume_all(rank, world, raw_first, variants):
    """On each rank: train and save, then build a trainer per variant and load the
    checkpoint into it; returns what each variant's param groups hold after the load."""
    import torch

    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training import checkpoint as ckpt
    from megatron_mvmoe.training.build import build_trainer
    from megatron_mvmoe.training.pretrain import pretrain

    run = config_from_dict(copy.deepcopy(raw_first))
    pgs = initialize_layout(run.parallel.layout(), timeout_s=60)
    pretrain(run, pgs)
    seen = {}
    for name, raw in variants.items():
        trainer = build_trainer(config_from_dict(copy.deepcopy(raw)), pgs)
        state = ckpt.load_checkpoint(trainer, raw["training"]["load"])
        moments = [float(s["exp_avg"].abs().sum()) for inner in
                   getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])
                   for s in inner.optimizer.state.values() if "exp_avg" in s]
        seen[name] = {"step": state.step, "num_steps": trainer.scheduler.num_steps,
                      "moments": sum(moments),
                      "groups": [{k: g.get(k) for k in ("lr", "max_lr", "min_lr",
                                                        "weight_decay", "wd_mult")}
                                 for g in trainer.optimizer.param_groups if g["params"]]}
        del trainer
        torch.manual_seed(0)
    return seen


def _check(seen, name, expected):
    assert seen["step"] == SAVED_AT and seen["num_steps"] == SAVED_AT, (name, seen)
    assert seen["moments"] > 0, (name, "Adam moments were not restored")
    for group in seen["groups"]:
        assert group["max_lr"] == pytest.approx(expected["lr"]), (name, group)
        assert group["min_lr"] == pytest.approx(expected["min_lr"]), (name, group)
        assert group["lr"] == pytest.approx(naive_lr(expected, SAVED_AT)), (name, group)
        assert group["weight_decay"] == pytest.approx(
            expected["weight_decay"] * group["wd_mult"]), (name, group)


def _matrix(text_tokens, tmp_path, parallel, world, distributed_optimizer, fmt):
    from megatron_mvmoe.testing.spawn import run_distributed

    root = str(tmp_path / "ck")
    opt = dict(BASE, use_distributed_optimizer=distributed_optimizer)
    training = dict(ckpt_optimizer_format=fmt)
    first = _raw(text_tokens, parallel, opt, train_iters=SAVED_AT, save=root, **training)
    variants = {f"{c}/{r}": _raw(text_tokens, parallel, dict(opt, **change), train_iters=8,
                                 load=root, **training, **rule)
                for c, change in CHANGES.items() for r, rule in RULES.items()}
    seen = run_distributed(_resume_all, world, timeout_s=400, args=(first, variants),
                           daemon=False)[0]
    for name, raw in variants.items():
        override = name.endswith("/override")
        _check(seen[name], name, dict(raw["optimizer"]) if override else BASE)


def test_changed_schedule_resumes_ep1_distributed(text_tokens, tmp_path):
    _matrix(text_tokens, tmp_path, {}, 1, True, "dp_reshardable")


@pytest.mark.slow
@pytest.mark.parametrize("parallel,world,distributed_optimizer,fmt", [
    ({}, 1, False, "dp_reshardable"),
    ({"ep": 2}, 2, True, "dp_reshardable"),
    ({"ep": 2}, 2, False, "dp_reshardable"),
    ({"ep": 2}, 2, True, "fully_reshardable"),
    ({}, 1, True, "fully_reshardable")],
    ids=["ep1-plain", "ep2-distributed", "ep2-plain", "ep2-fully", "ep1-fully"])
def test_changed_schedule_resumes(text_tokens, tmp_path, parallel, world, distributed_optimizer,
                                  fmt):
    _matrix(text_tokens, tmp_path, parallel, world, distributed_optimizer, fmt)


def test_issue_command_resumes_and_trains(text_tokens, tmp_path):
    """The issue's case end to end: --lr changed on resume, each rule; losses continue."""
    root = str(tmp_path / "ck")
    train(_raw(text_tokens, {}, BASE, train_iters=SAVED_AT, save=root), 1)
    for rule in RULES.values():
        out = train(_raw(text_tokens, {}, dict(BASE, lr=1e-3), train_iters=5, load=root,
                         **rule), 1)
        assert out["first_step"] == SAVED_AT + 1 and len(out["losses"]) == 2, out
        assert all(math.isfinite(v) for v in out["losses"])


def test_no_load_optim_keeps_step_and_data_finetune_does_not(text_tokens, tmp_path):
    """Megatron-LM's --no-load-optim: iteration and data position from the checkpoint
    (fresh optimizer, schedule from its step 0); --finetune: weights only, step 0."""
    root = str(tmp_path / "ck")
    full = train(_raw(text_tokens, {}, BASE, train_iters=5, save=root, save_interval=SAVED_AT),
                 1)
    with open(f"{root}/latest", "w") as fh:
        fh.write(f"iter_{SAVED_AT:07d}\n")
    resumed = train(_raw(text_tokens, {}, BASE, train_iters=5, load=root, load_optimizer=False),
                    1)
    assert resumed["first_step"] == SAVED_AT + 1 and len(resumed["losses"]) == 2
    # Same weights, same batch (data position kept): step 4's loss is the forward pass on
    # identical inputs, so it equals the uninterrupted run's step 4 loss.
    assert resumed["losses"][0] == pytest.approx(full["losses"][SAVED_AT], abs=1e-5)
    tuned = train(_raw(text_tokens, {}, BASE, train_iters=2, load=root, finetune=True), 1)
    assert tuned["first_step"] == 1 and len(tuned["losses"]) == 2
