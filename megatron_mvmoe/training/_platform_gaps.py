"""TEMPORARY: two CPU gaps of megatron_mvmoe.platform (0.16.1) met by the training loop.

To be removed once platform/cpu_patches.py covers them (requested from the integrator):
1. The Tensor.type() wrapper is applied to DistributedOptimizer's
   `_build_model_and_main_param_groups`, a *classmethod* in 0.16.1; wrapping the
   classmethod object makes it uncallable (TypeError: 'classmethod' object is not callable).
2. `megatron.core.utils.local_multi_tensor_l2_norm` (grad-norm without apex/TE) builds a
   tensor with device="cuda"; `megatron.core.utils` is not in the factory-redirect list.
Each fix applies only when its break is detected, so it is a no-op once fixed upstream.
"""

from __future__ import annotations

import importlib

import torch


def _fix_classmethod_wrapper() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron_mvmoe.platform import cpu_patches

    name = "_build_model_and_main_param_groups"
    current = DistributedOptimizer.__dict__[name]
    inner = getattr(current, "__wrapped__", None)
    if isinstance(inner, classmethod):
        setattr(DistributedOptimizer, name,
                classmethod(cpu_patches._with_cuda_type_names(inner.__func__)))


def _fix_utils_factories() -> None:
    from megatron_mvmoe.platform import cpu_patches

    utils = importlib.import_module("megatron.core.utils")
    if not isinstance(utils.torch, cpu_patches._CpuTorchProxy):
        utils.torch = cpu_patches._CpuTorchProxy()


def apply() -> None:
    if torch.cuda.is_available():
        return
    _fix_classmethod_wrapper()
    _fix_utils_factories()
