"""Start torch.distributed from whatever launcher started this process.

Design choices:
- The rendezvous is always an explicit `tcp://addr:port` init_method with explicit
  rank and world size (never `env://`), so Slurm and MPI launches that set no torch
  variables work the same as torchrun.
- The backend comes from the platform layer (`megatron_mvmoe.platform.backend()`:
  nccl on CUDA, gloo on CPU), and so does binding the process to device `local_rank`
  before the group is created (NCCL requires one device per process).
- Calling it twice is harmless: an already-initialised group is checked against the
  environment and reused.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from megatron_mvmoe import platform
from megatron_mvmoe.launch.rendezvous import Rendezvous, rendezvous_from_env

DEFAULT_TIMEOUT_S = 600.0
"""Rendezvous and collective timeout: long enough for slow multi-node start-up,
short enough that a missing rank fails the job instead of hanging it."""

BACKENDS = ("nccl", "gloo")


def _check_existing(rdzv: Rendezvous) -> Rendezvous:
    """A group already exists: it must agree with the launcher environment."""
    if (dist.get_rank(), dist.get_world_size()) != (rdzv.rank, rdzv.world_size):
        raise RuntimeError(
            f"torch.distributed is already initialised as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, but the {rdzv.launcher} environment says rank "
            f"{rdzv.rank} of {rdzv.world_size}; destroy the old process group first"
        )
    return rdzv


def device_index(local_rank: int, device_count: int) -> int:
    """Which visible device a process uses: its local rank, or the only visible device
    when the scheduler already gave each task its own (srun --gpus-per-task=1)."""
    if device_count == 1:
        return 0
    if not 0 <= local_rank < device_count:
        raise ValueError(
            f"local_rank={local_rank} but this process sees {device_count} devices; launch at "
            f"most {device_count} processes per node, or give each task one device"
        )
    return local_rank


def _bind_device(backend: str, rdzv: Rendezvous) -> None:
    """NCCL needs one device per process, bound before the group is created."""
    if backend != "nccl":
        return
    count = torch.accelerator.device_count()
    if count == 0:
        raise ValueError("backend='nccl' but no accelerator is visible; use backend='gloo' on CPU")
    platform.set_local_device(device_index(rdzv.local_rank, count))


def init_distributed(
    backend: Optional[str] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    env: Optional[Mapping[str, str]] = None,
) -> Rendezvous:
    """Create the default process group for this launch and return its Rendezvous.

    backend: "nccl" or "gloo"; None asks the platform layer. timeout_s bounds the
    rendezvous and every collective. env defaults to os.environ.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected one of {BACKENDS} or None (platform default)")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s}: must be > 0 seconds")
    rdzv = rendezvous_from_env(env)
    if dist.is_initialized():
        return _check_existing(rdzv)
    backend = backend or platform.backend()
    _bind_device(backend, rdzv)
    try:
        dist.init_process_group(
            backend=backend,
            init_method=rdzv.init_method,
            rank=rdzv.rank,
            world_size=rdzv.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    except (RuntimeError, dist.DistError) as err:
        raise RuntimeError(
            f"rank {rdzv.rank}/{rdzv.world_size} ({rdzv.launcher} launch) could not rendezvous at "
            f"{rdzv.init_method} within {timeout_s:.0f} s with {backend}: {err}. Check that every "
            "rank sees the same MASTER_ADDR/MASTER_PORT and that rank 0 is running"
        ) from err
    return rdzv
