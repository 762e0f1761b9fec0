"""A Megatron-Core 0.19.2 bug (still in Megatron-LM main at d98e8a64) that stops every
model with expert biases (Megatron-LM's default without --disable-bias-linear, GPT-3 MoE)
from training on SequentialMLP at expert TP = 1, on every platform: an expert MLP adds its
fc2 bias in place (`output += output_bias * per_token_scale`, transformer/mlp.py), and at
TP = 1 `reduce_from_tensor_model_parallel_region` hands fc2's output through an autograd
Function unchanged, so autograd sees a view of a custom Function's input modified in place
and raises. Fixed at the cause: at group size 1 the reduction is the identity both ways, so
the input is returned without the Function (no copy, same values and gradients); larger
groups run Megatron's own function. Applied with CUDA too (cpu_patches.UPSTREAM_FIXES).
"""

from __future__ import annotations

import functools
import importlib
from types import SimpleNamespace

import torch

from megatron_mvmoe.platform.patch import Patch, rebind

_MAPPINGS = "megatron.core.tensor_parallel.mappings"
_USERS = ("megatron.core.tensor_parallel.layers", "megatron.core.tensor_parallel",
          "megatron.core.transformer.moe.moe_utils")


def _identity_reduce_of_one_rank() -> None:
    mappings = importlib.import_module(_MAPPINGS)
    original = mappings.reduce_from_tensor_model_parallel_region

    @functools.wraps(original)
    def reduce_from_tensor_model_parallel_region(input_, group=None):
        if group is None:
            group = mappings.get_tensor_model_parallel_group_if_none(group)
        if group is not None and group.size() == 1:
            return input_  # what _ReduceFromModelParallelRegion computes, minus the view
        return original(input_, group)

    reduce_from_tensor_model_parallel_region._mvmoe_wrapped = True
    rebind(_MAPPINGS, "reduce_from_tensor_model_parallel_region",
           reduce_from_tensor_model_parallel_region, _USERS)


def _in_place_bias_add_breaks() -> bool:
    """The expert's in-place bias add on a one-rank reduction's output: through Megatron's
    Function where a name still calls it unwrapped, else through the name (no process group
    is needed for one rank)."""
    mappings = importlib.import_module(_MAPPINGS)
    one_rank = SimpleNamespace(size=lambda: 1)
    for module_name in (_MAPPINGS, *_USERS):
        reduce = importlib.import_module(module_name).reduce_from_tensor_model_parallel_region
        if not getattr(reduce, "_mvmoe_wrapped", False):
            reduce = mappings._ReduceFromModelParallelRegion.apply
        with torch.enable_grad():
            output = reduce(torch.ones(2, requires_grad=True) * 2.0, one_rank)
            try:
                output += 1.0
            except RuntimeError:
                return True
    return False


EXPERT_BIAS_FIXES = [
    Patch("expert biases at TP 1",
          "MLP.forward adds an expert's fc2 bias in place to the output of a one-rank "
          "_ReduceFromModelParallelRegion (a view of the Function's input): autograd "
          "refuses, so expert biases cannot train on SequentialMLP.",
          _identity_reduce_of_one_rank, _in_place_bias_add_breaks),
]
