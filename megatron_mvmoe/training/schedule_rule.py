"""The rule for resuming with a changed LR / weight-decay schedule (Megatron-LM's flags).

A checkpoint stores the scheduler's settings (peak and floor LR, warmup and decay steps,
weight-decay schedule) next to its step count. Resuming with another --train-iters (hence
another decay length), --lr, --min-lr, ... must pick one of the two:
- `--use-checkpoint-opt-param-scheduler` (also the default when neither flag is given):
  the checkpoint's schedule continues; when this run's config differs, a warning names
  every differing field and the flag that applies the new schedule. (Megatron-LM refuses
  a mismatch when neither flag is given; we keep the checkpoint's, so that a restarted job
  never fails, but never silently.)
- `--override-opt-param-scheduler`: the config's schedule, evaluated at the checkpoint's
  step (the step count is always the checkpoint's), and a line says so.
Megatron's OptimizerParamScheduler does the choosing (`_check_and_set`); this module only
builds it with the right switches and reports the differences. The optimizer's param groups
carry max_lr / min_lr too (the scheduler reads them first): resume_groups.py loads them
under a changed schedule and gives them the values the same rule picks.
"""

from __future__ import annotations

from typing import Dict, List, Optional

SCHEDULE_FIELDS = {
    "max_lr": "--lr", "min_lr": "--min-lr", "lr_warmup_steps": "--lr-warmup-iters",
    "lr_decay_steps": "--lr-decay-iters / --train-iters", "lr_decay_style": "decay style",
    "start_wd": "--weight-decay", "end_wd": "--weight-decay",
    "wd_incr_steps": "--lr-decay-iters / --train-iters", "wd_incr_style": "wd style",
}
"""Scheduler state-dict keys that describe the schedule (not the position), with the flag
that sets each."""


def scheduler_switches(training) -> Dict[str, bool]:
    """Keyword arguments for OptimizerParamScheduler from a TrainingSection."""
    override = bool(training.override_opt_param_scheduler)
    return {"override_opt_param_scheduler": override,
            "use_checkpoint_opt_param_scheduler": not override}


def schedule_changes(configured: Dict, saved: Dict) -> List[str]:
    """'field: checkpoint X vs this run Y (flag)' for every schedule field that differs."""
    changes = []
    for key, flag in SCHEDULE_FIELDS.items():
        if key in saved and key in configured and saved[key] != configured[key]:
            changes.append(f"{key}: checkpoint {saved[key]} vs this run {configured[key]} "
                           f"({flag})")
    return changes


def describe_schedule(scheduler) -> str:
    """The schedule a scheduler runs, for a log line."""
    state = scheduler.state_dict()
    return ", ".join(f"{key} {state[key]}" for key in SCHEDULE_FIELDS if key in state)


GROUP_VALUES = ("max_lr", "min_lr", "start_wd", "end_wd")
"""Schedule values Megatron's param groups carry (read before the scheduler's own)."""


def _groups_follow_scheduler(scheduler, configured: Dict) -> None:
    """Param groups that were not restored from the checkpoint carry this run's schedule
    values, which Megatron's scheduler reads before its own: give each group still holding
    this run's value the value the scheduler kept (per-group overrides stay)."""
    for group in scheduler.optimizer.param_groups:
        for key in GROUP_VALUES:
            if key in group and group[key] == configured.get(key):
                group[key] = getattr(scheduler, key)


def restore_scheduler(scheduler, saved: Dict, training, fresh_groups: bool = False
                      ) -> Optional[str]:
    """Load the checkpoint's scheduler state under the rule; returns the line to print
    (None when the schedules agree). `fresh_groups`: the optimizer state was not restored
    (a weights-only checkpoint), so the groups hold this run's values: when the
    checkpoint's schedule is kept they take its values too, so the kept schedule is the
    one that runs."""
    configured = scheduler.state_dict()
    changes = schedule_changes(configured, saved)
    scheduler.load_state_dict(saved)
    if fresh_groups and not training.override_opt_param_scheduler:
        _groups_follow_scheduler(scheduler, configured)
    # Megatron's load_state_dict sets every group's lr / weight_decay (its step()) before it
    # sets start_wd / end_wd: refresh them, or the first resumed step runs at the old WD.
    scheduler.step(increment=0)
    if not changes:
        return None
    step = saved.get("num_steps", saved.get("num_iters"))
    if training.override_opt_param_scheduler:
        return (f"resume: this run's LR/WD schedule replaces the checkpoint's from step {step} "
                f"(--override-opt-param-scheduler): {'; '.join(changes)}")
    how = ("--use-checkpoint-opt-param-scheduler" if training.use_checkpoint_opt_param_scheduler
           else "the default")
    return (f"warning: resume keeps the checkpoint's LR/WD schedule ({how}); this run's "
            f"config differs and is ignored for the schedule: {'; '.join(changes)}. Fix: pass "
            f"--override-opt-param-scheduler to apply this run's schedule from step {step}")
