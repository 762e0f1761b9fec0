"""Megatron-Core 0.19.2's distributed optimizer on torch's Adam (no apex, no TransformerEngine:
every CPU run, and a GPU run without either): three break points of its checkpoint load, each
a Patch with a probe (platform/patch.py). Written for 0.16.1 as trainer-side repairs in
training/checkpoint.py, re-checked on 0.19.2: still needed (without the step repair,
tests/training/test_training.py::test_resume_is_bit_identical_and_reshards fails).

- states missing from a checkpoint: a fully_reshardable checkpoint carries param, exp_avg and
  exp_avg_sq but not torch Adam's per-parameter `step`; the load copies every destination
  key (KeyError 'step'). CPU only (registered in cpu_patches.PATCHES).
- dummy states before a load: `sharded_state_dict(is_loading=True)` calls `state_dict()`,
  which reads one `step` from every Adam state and asserts there is exactly one; a fresh
  optimizer has none. Megatron's FSDP path builds placeholder states first
  (`_init_optimizer_states_with_dummy_values`); the non-FSDP path does not. Every platform.
- one step per parameter after a load: `load_state_dict` gives every state the SAME step
  tensor (`s["step"] = step`), which torch's AdamW then increments once per parameter, and
  on the fully_reshardable path the states keep the placeholders' step (1). The saved step
  is in each param group: each state gets its own copy of it. Every platform.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch

from megatron_mvmoe.platform.patch import Patch

_DISTRIB = "megatron.core.optimizer.distrib_optimizer"


def _distrib():
    return importlib.import_module(_DISTRIB)


def _torch_adam_path() -> bool:
    return not _distrib().HAVE_APEX_OR_TE


def _keep_states_missing_from_checkpoint() -> None:
    """Without apex/TE the optimizer is torch's Adam, whose per-parameter state also holds
    `step`; the fully_reshardable checkpoint carries only param/exp_avg/exp_avg_sq, and
    `_set_main_param_and_optimizer_states` copies every destination key (KeyError 'step').
    Keys the checkpoint lacks keep their current value (the trainer restores the step)."""
    module = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    cls = module.DistributedOptimizer
    original = cls._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def set_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            current = self._get_main_param_and_optimizer_states(model_param)
            tensors = {**{k: v for k, v in current.items() if k not in tensors}, **tensors}
        return original(self, model_param, tensors)

    set_states._mvmoe_wrapped = True
    cls._set_main_param_and_optimizer_states = set_states


def _optimizer_states_break() -> bool:
    import inspect

    module = importlib.import_module("megatron.core.optimizer.distrib_optimizer")
    fn = module.DistributedOptimizer._set_main_param_and_optimizer_states
    return (not getattr(fn, "_mvmoe_wrapped", False)
            and "for key in dst_tensors" in inspect.getsource(fn))


# ----------------------------------------------------------- dummy states before a load
def _dummy_states_before_load() -> None:
    cls = _distrib().DistributedOptimizer
    original = cls.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False,
                           *args, **kwargs):
        if is_loading and _torch_adam_path() and len(self.optimizer.state) == 0:
            self._init_optimizer_states_with_dummy_values()  # overwritten by the load
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    sharded_state_dict._mvmoe_wrapped = True
    cls.sharded_state_dict = sharded_state_dict


def _fresh_optimizer_cannot_load() -> bool:
    cls = _distrib().DistributedOptimizer
    return (_torch_adam_path() and not getattr(cls.sharded_state_dict, "_mvmoe_wrapped", False)
            and 'steps = list(set([s["step"].item()' in inspect.getsource(cls.state_dict)
            and "_init_optimizer_states_with_dummy_values" not in
            inspect.getsource(cls.sharded_state_dict))


# ------------------------------------------------------- one step per parameter after a load
def give_each_state_its_group_step(torch_optimizer: torch.optim.Optimizer) -> None:
    """Every Adam state gets its own tensor holding its param group's saved step."""
    for group in torch_optimizer.param_groups:
        if group.get("step") is None:
            continue
        for param in group["params"]:
            state = torch_optimizer.state.get(param)
            if state and torch.is_tensor(state.get("step")):
                state["step"] = torch.tensor(float(group["step"]), dtype=state["step"].dtype)


def _step_per_parameter_after_load() -> None:
    cls = _distrib().DistributedOptimizer
    original = cls.load_state_dict

    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        result = original(self, state_dict)
        if _torch_adam_path():
            give_each_state_its_group_step(self.optimizer)
        return result

    load_state_dict._mvmoe_wrapped = True
    cls.load_state_dict = load_state_dict


def _load_shares_one_step() -> bool:
    fn = _distrib().DistributedOptimizer.load_state_dict
    return (_torch_adam_path() and not getattr(fn, "_mvmoe_wrapped", False)
            and 's["step"] = step' in inspect.getsource(fn))


STATES_MISSING_FROM_CHECKPOINT = Patch(
    "optimizer states missing from a checkpoint",
    "loading a fully_reshardable optimizer checkpoint into torch's Adam (no apex/TE) fails "
    "with KeyError 'step' in _set_main_param_and_optimizer_states.",
    _keep_states_missing_from_checkpoint, _optimizer_states_break)

EVERY_PLATFORM = [
    Patch("torch-Adam dummy states before a load",
          "sharded_state_dict(is_loading=True) on a fresh torch-Adam DistributedOptimizer "
          "asserts in state_dict() (no 'step' yet); only the FSDP path builds placeholders.",
          _dummy_states_before_load, _fresh_optimizer_cannot_load),
    Patch("torch-Adam step per parameter after a load",
          "load_state_dict gives every Adam state one shared step tensor (incremented once "
          "per parameter by AdamW) or keeps the placeholders' step: resumes drift.",
          _step_per_parameter_after_load, _load_shares_one_step),
]
