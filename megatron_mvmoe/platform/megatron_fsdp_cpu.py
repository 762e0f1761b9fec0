"""Megatron-FSDP (megatron.core.distributed.fsdp, Megatron-LM's --use-megatron-fsdp) on a CPU
build of torch with gloo.

Probed on 2 gloo ranks through training/build.py (issue 36): Megatron-FSDP shards, gathers and
reduces with collectives gloo has (all_gather_into_tensor, reduce_scatter_tensor, all_reduce
inside _coalescing_manager) and needs only the three stand-ins below, each at a point where it
names the CUDA device literally. With them FSDP trains to the losses of DDP with the
distributed optimizer (tests/training/test_megatron_fsdp.py). A fourth break, the
NCCL-only `_make_nccl_premul_sum` reduce op of `gradient_reduce_div_fusion`, is not patched:
the run's DDP config turns the fusion off on gloo (training/build.py), which scales the
gradients before a SUM reduction, Megatron's own unfused branch.

- Device strings: megatron_fsdp.py compares its device with
  `torch.device(f"cuda:{torch.cuda.current_device()}")`, which the CPU shim's "cpu" device
  turns into the invalid "cuda:cpu"; the two FSDP modules see a `torch` whose `device()`
  maps every CUDA spelling to the CPU (the real `torch` is unchanged for other code).
- Device mesh: the adapter builds its DTensor meshes with `device_type="cuda"`, so
  `DTensor.from_local` moves every shard to CUDA; on CPU the meshes are CPU meshes over the
  same gloo groups.
- Uneven DTensor check: `validate_uneven_dtensor` moves its boundary flags with `.cuda()`
  before an all-reduce; on CPU they stay where they are.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch

from megatron_mvmoe.platform.cpu_embedding_copy import tensor_cuda_stays_on_this_device
from megatron_mvmoe.platform.patch import Patch, rebind

_FSDP = "megatron.core.distributed.fsdp.src.megatron_fsdp"
_DEVICE_MODULES = (f"{_FSDP}.megatron_fsdp", f"{_FSDP}.param_and_grad_buffer")
_ADAPTER = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"
_UNEVEN = f"{_FSDP}.uneven_dtensor"


def _cpu_device(*args, **kwargs) -> torch.device:
    if args and "cuda" in str(args[0]):
        return torch.device("cpu")
    return torch.device(*args, **kwargs)


class _CpuDeviceTorch:
    """`torch` as one Megatron-FSDP module sees it: `torch.device` of a CUDA spelling is the
    CPU."""

    device = staticmethod(_cpu_device)

    def __getattr__(self, name: str):
        return getattr(torch, name)


def fsdp_devices_on_cpu() -> None:
    for name in _DEVICE_MODULES:
        importlib.import_module(name).torch = _CpuDeviceTorch()


def fsdp_devices_break() -> bool:
    module_torch = importlib.import_module(_DEVICE_MODULES[0]).torch
    try:
        module_torch.device(f"cuda:{torch.cuda.current_device()}")
    except (AssertionError, RuntimeError):
        return True
    return False


class _CpuDeviceMesh:
    """The adapter's `DeviceMesh`: meshes built from its process groups are CPU meshes."""

    @staticmethod
    def from_group(*args, **kwargs):
        from torch.distributed import DeviceMesh

        return DeviceMesh.from_group(*args, **dict(kwargs, device_type="cpu"))


def fsdp_meshes_on_cpu() -> None:
    importlib.import_module(_ADAPTER).DeviceMesh = _CpuDeviceMesh


def fsdp_meshes_break() -> bool:
    adapter = importlib.import_module(_ADAPTER)
    source = inspect.getsource(adapter.FullyShardedDataParallel._init_dist_index)
    return adapter.DeviceMesh is not _CpuDeviceMesh and 'device_type="cuda"' in source


def uneven_check_on_cpu() -> None:
    original = importlib.import_module(_UNEVEN).validate_uneven_dtensor
    if getattr(original, "_mvmoe_wrapped", False):
        return

    @functools.wraps(original)
    def validate_uneven_dtensor(*args, **kwargs):
        with tensor_cuda_stays_on_this_device():
            return original(*args, **kwargs)

    validate_uneven_dtensor._mvmoe_wrapped = True
    rebind(_UNEVEN, "validate_uneven_dtensor", validate_uneven_dtensor,
           (f"{_FSDP}.param_and_grad_buffer",))


def uneven_check_breaks() -> bool:
    fn = importlib.import_module(f"{_FSDP}.param_and_grad_buffer").validate_uneven_dtensor
    return not getattr(fn, "_mvmoe_wrapped", False) and ".cuda()" in inspect.getsource(fn)


MEGATRON_FSDP_ON_CPU = (
    Patch("Megatron-FSDP device strings",
          "megatron_fsdp.py builds torch.device(f'cuda:{torch.cuda.current_device()}'), "
          "'cuda:cpu' under the CPU shim.",
          fsdp_devices_on_cpu, fsdp_devices_break),
    Patch("Megatron-FSDP device meshes",
          "mcore_fsdp_adapter builds its DTensor meshes with device_type='cuda', so "
          "DTensor.from_local moves each shard to CUDA.",
          fsdp_meshes_on_cpu, fsdp_meshes_break),
    Patch("Megatron-FSDP uneven DTensor check",
          "validate_uneven_dtensor moves its boundary flags with .cuda() before an "
          "all-reduce.",
          uneven_check_on_cpu, uneven_check_breaks),
)
