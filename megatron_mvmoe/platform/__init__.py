"""Device and backend set-up: CUDA + NCCL with stock Megatron-Core, or CPU + gloo with the
patches in `cpu_patches`. The only place in megatron_mvmoe that touches `torch.cuda`."""

from __future__ import annotations

import random

import numpy as np
import torch

from megatron_mvmoe.platform.cpu_patches import PATCHES, apply_cpu_patches

__all__ = ["PATCHES", "apply_cpu_patches", "backend", "device", "is_cuda", "seed_all",
           "peak_memory_bytes", "reset_megatron_process_state", "synchronize",
           "device_rng_state", "set_device_rng_state"]


def is_cuda() -> bool:
    """True when a CUDA device is usable."""
    return torch.cuda.is_available()


def device() -> torch.device:
    """The device this process computes on: its local CUDA device, or the CPU."""
    if is_cuda():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    """The torch.distributed backend for this platform."""
    return "nccl" if is_cuda() else "gloo"


def set_local_device(local_rank: int) -> None:
    """Bind this process to its GPU (no-op on CPU)."""
    if is_cuda():
        torch.cuda.set_device(local_rank)


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch, and Megatron's model-parallel RNG tracker once the
    parallel state exists (on CPU the tracker forks the CPU generator, see cpu_patches)."""
    from megatron.core import parallel_state, tensor_parallel

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if parallel_state.model_parallel_is_initialized():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def device_rng_state():
    """The CUDA default generator's state (hidden dropout outside tensor-parallel regions
    draws from it), or None on the CPU, where the torch generator is that stream."""
    return torch.cuda.get_rng_state() if is_cuda() else None


def set_device_rng_state(state) -> None:
    """Restore what `device_rng_state` returned (no-op on the CPU)."""
    if is_cuda():
        torch.cuda.set_rng_state(state)


def device_name() -> str:
    """The CUDA device's name, or "cpu"."""
    return torch.cuda.get_device_name() if is_cuda() else "cpu"


def cuda_version():
    """torch's CUDA version when a device is usable, else None."""
    return torch.version.cuda if is_cuda() else None


def synchronize() -> None:
    """Wait for queued device work (timing); CPU work is already synchronous."""
    if is_cuda():
        torch.cuda.synchronize()


def peak_memory_bytes() -> int:
    """Peak memory of this process: CUDA allocator peak, or the CPU's max RSS."""
    if is_cuda():
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def reset_peak_memory() -> None:
    if is_cuda():
        torch.cuda.reset_peak_memory_stats()


def reset_megatron_process_state() -> None:
    """Fresh Megatron process-level state for a forked child (the test spawner's ranks).

    A fork inherits Megatron's class- and module-level state from its parent: e.g. an
    aux-loss backward run there leaves a 0-d `MoEAuxLossAutoScaler.main_loss_backward_scale`,
    and the schedule's later `set_loss_scale` with a [1]-shaped scale then fails to copy
    into it; the parent's MoE metrics tracker would also carry its recorded values over.
    Megatron's own resets, no patching."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    destroy_moe_metrics_tracker()
