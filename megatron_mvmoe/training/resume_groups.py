"""Resuming with another LR / weight-decay schedule: pairing the saved optimizer param groups.

Megatron-Core 0.19.2 pairs each saved param group with the current one by
`param_group_identifier_keys` (optimizer.py:139), which include the schedule values of
ParamGroupOverride (max_lr, min_lr, start_wd, end_wd). A run resumed with another --lr or
--min-lr therefore finds no saved group under its key: KeyError in
`DistributedOptimizer.load_state_dict`, ValueError in `FP32Optimizer` / `Float16Optimizer`
(`_filter_and_reorder_param_groups`). Megatron-LM's own `load_checkpoint` (main, checked
at d98e8a6) loads the groups the same way and only afterwards, under
--override-opt-param-scheduler, writes args.lr / args.min_lr back into every group.

What this module does, through Megatron's own matching (no patch of Megatron):
- before `optimizer.load_state_dict`, every saved group is paired with the current group of
  the same STRUCTURE (the identifier keys minus the schedule values: lr_mult, wd_mult,
  optimizer, is_expert_parallel, is_decoupled_lr) and given the current group's schedule
  values, so Megatron's matcher finds it; the checkpoint's values are kept aside;
- after the load, the rule of schedule_rule.py picks the values: this run's under
  --override-opt-param-scheduler (what Megatron-LM writes back), the checkpoint's
  otherwise (the scheduler keeps the checkpoint's schedule too, so the two agree).
Groups whose structure is not unique (per-group LR overrides that differ only in max_lr)
are left as saved: Megatron's full-key matching applies to them unchanged.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

SCHEDULE_KEYS = ("max_lr", "min_lr", "start_wd", "end_wd")
"""Per-group schedule values (ParamGroupOverride) that a resume may change."""

Schedules = List[List[Optional[Dict]]]
"""Per Megatron optimizer, per current group: the checkpoint's schedule values (None:
the group was left to Megatron's matching)."""


def structural_keys() -> Tuple[str, ...]:
    """Megatron's identifier keys without the schedule values."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    return tuple(k for k in param_group_identifier_keys if k not in SCHEDULE_KEYS)


def _identity(group: Dict, keys: Sequence[str]) -> tuple:
    """As Megatron's matcher reads a group: NeMo's `pre_` aliases, missing == None."""
    return tuple(group.get(k, group.get(f"pre_{k}")) for k in keys)


def inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def per_optimizer_states(optimizer, state) -> list:
    """The saved state of each Megatron optimizer, as ChainedOptimizer.load_state_dict
    hands them out (one optimizer: the whole dict; several: by sorted index)."""
    inners = inner_optimizers(optimizer)
    if len(inners) == 1:
        return [state]
    if isinstance(state, dict):
        return [v for _, v in sorted(state.items())]
    return list(state)


def _saved_groups(state: Dict) -> List[Dict]:
    """The saved param groups: FP32Optimizer keeps them at the top level, the distributed
    and float16 optimizers under 'optimizer' (older checkpoints 'optimizer_state_dict')."""
    if "param_groups" in state:
        return state["param_groups"]
    inner = state.get("optimizer", state.get("optimizer_state_dict"))
    return inner["param_groups"]


def _schedule_of(group: Dict) -> Dict:
    return {k: group[k] for k in SCHEDULE_KEYS if k in group}


def _set_schedule(group: Dict, values: Dict) -> None:
    for key in SCHEDULE_KEYS:
        if key in values:
            group[key] = values[key]
        else:
            group.pop(key, None)


def align_groups(current: List[Dict], saved: List[Dict]) -> List[Optional[Dict]]:
    """Give each saved group the schedule values of the current group with its structure;
    returns, per current group, the checkpoint's values (None where left as saved)."""
    keys = structural_keys()
    current_ids = [_identity(g, keys) for g in current]
    saved_ids = [_identity(g, keys) for g in saved]
    checkpoint_values: List[Optional[Dict]] = []
    for group, ident in zip(current, current_ids):
        if current_ids.count(ident) != 1 or saved_ids.count(ident) != 1:
            checkpoint_values.append(None)
            continue
        match = saved[saved_ids.index(ident)]
        checkpoint_values.append(_schedule_of(match))
        _set_schedule(match, _schedule_of(group))
    return checkpoint_values


def align_saved_groups(optimizer, state) -> Schedules:
    """Before `optimizer.load_state_dict(state)`: align every Megatron optimizer's saved
    groups with its current ones (in place); returns the checkpoint's schedule values."""
    return [align_groups(inner.optimizer.param_groups, _saved_groups(sub))
            for inner, sub in zip(inner_optimizers(optimizer),
                                  per_optimizer_states(optimizer, state))]


def apply_schedule_rule(optimizer, checkpoint_values: Schedules, override: bool) -> None:
    """After the load: the groups carry this run's schedule values; without
    --override-opt-param-scheduler put the checkpoint's back (torch's load keeps the order
    of the current groups, which Megatron's matcher produced)."""
    if override:
        return
    for inner, values in zip(inner_optimizers(optimizer), checkpoint_values):
        for group, saved in zip(inner.optimizer.param_groups, values):
            if saved is not None:
                _set_schedule(group, saved)
