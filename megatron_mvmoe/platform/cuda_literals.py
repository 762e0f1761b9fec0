"""Megatron-Core 0.19.2's literal CUDA names on a CPU build of torch (CPU patches registered
in cpu_patches.PATCHES): tensors built with `device="cuda"`, and `Tensor.type()` strings
compared against `torch.cuda.*Tensor`.

Design choices:
- `device="cuda"` factory calls are redirected only inside the Megatron modules known to
  make them, through a module-local proxy of `torch`; the real `torch` is never changed
  for other code.
- `Tensor.type()` reports the CUDA type name only while the distributed optimizer and the
  gradient-clipping helpers run (they dispatch on those names).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect

import torch

from megatron_mvmoe.platform.patch import Patch


# ------------------------------------------------------ device="cuda" inside Megatron
def _to_cpu_device(kwargs: dict) -> dict:
    device = kwargs.get("device")
    if device is not None and "cuda" in str(device):
        kwargs = dict(kwargs, device="cpu")
    return kwargs


class _CpuTorchProxy:
    """`torch` as seen by one Megatron module: factories map device='cuda' to the CPU."""

    _FACTORIES = ("zeros", "ones", "empty", "tensor", "full", "arange", "empty_like")

    def __getattr__(self, name: str):
        attr = getattr(torch, name)
        if name in self._FACTORIES:
            return functools.partial(_call_on_cpu, attr)
        return attr


def _call_on_cpu(factory, *args, **kwargs):
    return factory(*args, **_to_cpu_device(kwargs))


# Megatron modules that build tensors with a literal device="cuda" on paths we use.
_CUDA_FACTORY_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.transformer.utils",
    "megatron.core.rerun_state_machine",
    "megatron.core.utils",  # local_multi_tensor_l2_norm (grad norm without apex/TE)
    # 0.19.2: the saver's cached-metadata reuse check (async saves with a constant
    # structure) and the fully-parallel load's exchange buffers
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.exchange_utils",
    # 0.19.2: layer-wise Muon's grad-norm-group flag (has_grad_norm_group), issue 36
    "megatron.core.optimizer.layer_wise_optimizer",
)


def _redirect_cuda_factories() -> None:
    for module_name in _CUDA_FACTORY_MODULES:
        module = importlib.import_module(module_name)
        module.torch = _CpuTorchProxy()


def _cuda_factories_break() -> bool:
    for module_name in _CUDA_FACTORY_MODULES:
        module_torch = importlib.import_module(module_name).torch
        try:
            module_torch.zeros(1, device="cuda")
        except (AssertionError, RuntimeError):
            return True
    return False


# -------------------------------------------------- Tensor.type() string comparisons
_CPU_TO_CUDA_TYPE = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


@contextlib.contextmanager
def _cuda_type_names():
    """While active, CPU float tensors report their CUDA type name from `.type()`."""
    original = torch.Tensor.type

    def type_as_cuda(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None:
            name = original(self)
            return _CPU_TO_CUDA_TYPE.get(name, name)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_as_cuda
    try:
        yield
    finally:
        torch.Tensor.type = original


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    wrapper._mvmoe_wrapped = True
    return wrapper


_TYPE_NAME_FUNCTIONS = (
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer",
     "_build_model_and_main_param_groups"),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params", "__init__"),
)


def _wrap_type_name_functions() -> None:
    for module_name, class_name, method in _TYPE_NAME_FUNCTIONS:
        cls = getattr(importlib.import_module(module_name), class_name)
        fn = cls.__dict__[method]
        if isinstance(fn, (staticmethod, classmethod)):  # rewrap the same descriptor kind
            setattr(cls, method, type(fn)(_with_cuda_type_names(fn.__func__)))
        else:
            setattr(cls, method, _with_cuda_type_names(fn))
    clip_grads = importlib.import_module("megatron.core.optimizer.clip_grads")
    clip_grads.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(
        clip_grads.clip_grad_by_total_norm_fp32)
    optimizer = importlib.import_module("megatron.core.optimizer.optimizer")
    optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32


def _type_names_break() -> bool:
    """Needed while Megatron still compares CUDA type names in a method we have not
    wrapped yet."""
    for module_name, class_name, method in _TYPE_NAME_FUNCTIONS:
        fn = getattr(importlib.import_module(module_name), class_name).__dict__[method]
        fn = getattr(fn, "__func__", fn)
        if getattr(fn, "_mvmoe_wrapped", False):
            continue
        if "torch.cuda." in inspect.getsource(fn) and "Tensor" in inspect.getsource(fn):
            return True
    return False


CUDA_FACTORIES = Patch(
    "device='cuda' factories",
    "schedules, clip_grads, optimizer, grad_scaler, transformer.utils, rerun state, "
    "the checkpoint saver's reuse check and the load exchange build tensors with a "
    "literal device='cuda'.",
    _redirect_cuda_factories, _cuda_factories_break)

CUDA_TYPE_NAMES = Patch(
    "Tensor.type() names",
    "The distributed optimizer, the fp16 optimizer and grad clipping dispatch on "
    "'torch.cuda.*Tensor' strings.",
    _wrap_type_name_functions, _type_names_break)
