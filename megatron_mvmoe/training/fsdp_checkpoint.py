"""The tensor parts of a Megatron-FSDP checkpoint, Megatron-LM's --ckpt-format fsdp_dtensor:
torch DCP of the model's and the distributed optimizer's DTensors.

Megatron-FSDP replaces every parameter with a DTensor sharded over the data-parallel ranks;
Megatron-LM saves such a model as `model.state_dict_for_save_checkpoint()` plus the optimizer's
`fsdp_dtensor` sharded state (one entry per parameter name, each moment a DTensor), both
through `torch.distributed.checkpoint` (megatron/training/checkpointing.py). This module does
the same; everything else of the checkpoint (run_state.json, the per-rank RNG files, the
manifest, the publish) is the trainer's usual machinery (training/checkpoint.py).

Design choices:
- Expert parameters are saved under their global expert index
  (Megatron-Core's `handle_experts_in_state_dict`, which the optimizer's names already use), and
  Megatron-FSDP's uneven shards get their chunk metadata (`preprocess_state_dict_for_uneven_dtensor`),
  as Megatron-LM preprocesses them.
- Megatron-LM also splits SwiGLU's fc1 into its two halves so a checkpoint can load at another
  TP size; Megatron-Core 0.19.2's split of the optimizer moments resolves parameter names one
  wrapper level off (AttributeError on our wrapped model) and meets ranks holding different
  keys (below). Not split here: a checkpoint resumes at its saved TP/PP/EP, which the loader
  checks (`check_fsdp_layout`), and at any data-parallel size (DCP reshards the DTensors).
- A parameter whose shard on this rank is empty has no gradient and so no Adam state here
  (Megatron-FSDP sets its grad to None), so ranks hold different optimizer keys, while the
  uneven-DTensor preprocessing runs a collective per DTensor key: every rank must list every
  parameter. The missing moments are added as empty-shard zeros (`_with_every_parameter`);
  they are written by no rank and loaded into throwaway tensors.
- A load fills the DTensors in place (DCP), then hands the model and optimizer their state
  dicts (`load_state_dict`), as Megatron-LM does.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
    preprocess_state_dict_for_uneven_dtensor)
from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict

from megatron_mvmoe.checkpointing.errors import CheckpointError
from megatron_mvmoe.training.checkpoint_parts import TENSORS
from megatron_mvmoe.training.resume_groups import (align_saved_groups, apply_schedule_rule,
                                                   inner_optimizers, per_optimizer_states)

FORMAT = "fsdp_dtensor"
MOMENTS = ("exp_avg", "exp_avg_sq")
"""Adam's per-parameter DTensor states (its `step` is a plain tensor, written by one rank)."""


class FsdpModelPart:
    """The weights of this rank's Megatron-FSDP chunks (`model<i>`: each wrapper's
    `state_dict_for_save_checkpoint()`, DTensors)."""

    name, store = "model", TENSORS

    def __init__(self, wrapped: List[torch.nn.Module], num_experts: Optional[int]) -> None:
        self.wrapped, self.num_experts = wrapped, num_experts

    def state_dict(self) -> Dict:
        return {f"model{i}": chunk.state_dict_for_save_checkpoint()
                for i, chunk in enumerate(self.wrapped)}

    def load_state_dict(self, state: Dict) -> None:
        for i, chunk in enumerate(self.wrapped):
            chunk.load_state_dict(state[f"model{i}"], strict=True)


class FsdpOptimizerPart:
    """Megatron's distributed optimizer over Megatron-FSDP, in its `fsdp_dtensor` sharded
    form (`optimizer`: state per parameter name, param_to_group_meta)."""

    name, store = "optimizer", TENSORS
    format = FORMAT

    def __init__(self, optimizer, override_scheduler: bool) -> None:
        self.optimizer, self.override_scheduler = optimizer, override_scheduler

    def state_dict(self, is_loading: bool = False) -> Dict:
        return {"optimizer": self.optimizer.sharded_state_dict(
            {}, is_loading=is_loading, metadata={"distrib_optim_sharding_type": FORMAT})}

    def load_state_dict(self, state: Dict) -> None:
        """The optimizer's load of the filled state, with the saved param groups paired by
        structure and the schedule rule applied (as the torch_dist part does)."""
        state = state["optimizer"]
        for inner, sub in zip(inner_optimizers(self.optimizer),
                              per_optimizer_states(self.optimizer, state)):
            _groups_from_names(inner, sub)
        checkpoint_values = align_saved_groups(self.optimizer, state)
        with torch.no_grad():
            self.optimizer.load_state_dict(state)
        apply_schedule_rule(self.optimizer, checkpoint_values, self.override_scheduler)


def _groups_from_names(inner, state: Dict) -> None:
    """The saved `param_to_group_meta` (group values per parameter name) as torch's
    param_groups, in place, by Megatron's own conversion (its load_state_dict would do the
    same later), so the groups can be paired and given the schedule rule first."""
    if "param_to_group_meta" in state:
        state["param_groups"] = inner._param2group_meta_to_param_groups(
            state.pop("param_to_group_meta"), inner.optimizer.param_groups)


def _with_every_parameter(optimizer, optimizer_state: Dict) -> Dict:
    """`optimizer_state` (the fsdp_dtensor form, one dict per Megatron optimizer) with an
    empty-shard zero moment for every parameter that has no Adam state on this rank (module
    docstring)."""
    inners = inner_optimizers(optimizer)
    filled = [_filled(inner, sub) for inner, sub
              in zip(inners, per_optimizer_states(optimizer, optimizer_state))]
    if len(inners) == 1:
        return filled[0]
    return dict(zip(sorted(optimizer_state), filled))


def _filled(inner, sub: Dict) -> Dict:
    state = dict(sub["state"])
    for group in inner.optimizer.param_groups:
        for param in group["params"]:
            name = inner._param_name(param)
            if name not in state:
                state[name] = {m: torch.zeros_like(param) for m in MOMENTS}
    return dict(sub, state=state)


def _dcp_state(parts: Dict, is_loading: bool) -> Tuple[Dict, Dict]:
    """(what DCP writes or fills, the parts' own state dicts sharing its tensors)."""
    own = dict(parts["model"].state_dict())
    if "optimizer" in parts:
        own.update(parts["optimizer"].state_dict(is_loading=is_loading))
    written = {key: handle_experts_in_state_dict(value, parts["model"].num_experts)
               for key, value in own.items() if key.startswith("model")}
    if "optimizer" in own:
        written["optimizer"] = _with_every_parameter(parts["optimizer"].optimizer,
                                                     own["optimizer"])
    preprocess_state_dict_for_uneven_dtensor(written)
    return written, own


def save_fsdp_tensors(parts: Dict, directory: str) -> None:
    """Collective: the model and (when in `parts`) optimizer DTensors into `directory`."""
    written, _ = _dcp_state(parts, is_loading=False)
    dcp.save(written, checkpoint_id=directory)


def load_fsdp_tensors(parts: Dict, directory: str) -> Dict:
    """Collective: fill the parts' DTensors from `directory`; returns their state dicts for
    each part's `load_state_dict`. A failure is one CheckpointError."""
    filled, own = _dcp_state(parts, is_loading=True)
    try:
        dcp.load(filled, checkpoint_id=directory)
    except Exception as err:  # noqa: BLE001 - DCP raises CheckpointException and others
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise CheckpointError(f"{directory}: reading the fsdp_dtensor tensors failed "
                              f"({type(err).__name__}: {first}). Fix: resume from the "
                              "previous checkpoint (--ckpt-step)") from err
    return own


def fsdp_weight_shards(wrapped: List[torch.nn.Module]):
    """This rank's (name, local shard) of every saved model DTensor (plain tensors as they
    are), the weights a save writes."""
    for i, chunk in enumerate(wrapped):
        for name, value in chunk.state_dict_for_save_checkpoint().items():
            if isinstance(value, torch.Tensor):
                yield (f"model{i}.{name}",
                       value.to_local() if isinstance(value, DTensor) else value)


def check_fsdp_layout(saved_layout: Optional[Dict], layout: Dict, directory: str) -> None:
    """An fsdp_dtensor checkpoint resumes at its saved TP/PP/EP/ETP/VPP (module docstring);
    only the data-parallel size may change."""
    if saved_layout is None or saved_layout == layout:
        return
    changed = ", ".join(f"{k} {saved_layout.get(k)} -> {v}" for k, v in layout.items()
                        if saved_layout.get(k) != v)
    raise CheckpointError(
        f"{directory}: an fsdp_dtensor checkpoint loads only at its saved tensor/pipeline/"
        f"expert layout ({changed}): its SwiGLU and expert weights are not split for "
        "resharding here. Fix: resume with the saved parallel sizes (any data-parallel size)")
