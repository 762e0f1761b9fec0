"""Megatron-LM's --check-weight-hash-across-dp-replicas-interval N: after every N-th step the
data-parallel replicas compare SHA-1 hashes of every parameter with Megatron-Core's
`check_param_hashes_across_dp_replicas(model, cross_check=True)` (expert parameters over the
expert-data-parallel group), as Megatron-LM's training loop does: a match logs Megatron-LM's
line, a mismatch stops the run naming the step (tests/training/test_weight_hash_check.py)."""

from __future__ import annotations

import contextlib
from typing import Callable, List

import torch
import torch.distributed as dist
from megatron.core.utils import check_param_hashes_across_dp_replicas

from megatron_mvmoe.platform.cpu_embedding_copy import tensor_cuda_stays_on_this_device


class ReplicaMismatch(RuntimeError):
    """The data-parallel replicas' weights differ (they must be bit-identical)."""


@contextlib.contextmanager
def _params_gathered(model: List[torch.nn.Module]):
    """With overlapped parameter gathers (distributed optimizer on a GPU) the weights are
    complete only after the next forward's pre-hook: disabling the hook gathers them now, as
    Megatron-LM's loop does around this check."""
    overlapped = [chunk for chunk in model if chunk.ddp_config.overlap_param_gather]
    for chunk in overlapped:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in overlapped:
            chunk.enable_forward_pre_hook()


def check_weight_hashes(model: List[torch.nn.Module], step: int,
                        log: Callable[[str], None]) -> None:
    """Megatron-Core's cross-replica hash check after `step`; raises ReplicaMismatch on every
    rank when any two replicas differ (each rank sees every hash, so all agree)."""
    # Megatron-Core moves the hashes to the GPU for the all-gather; on CPU they stay put.
    on_cpu = tensor_cuda_stays_on_this_device()
    with _params_gathered(model), on_cpu:
        same = check_param_hashes_across_dp_replicas(model, cross_check=True)
    if not same:
        raise ReplicaMismatch(
            f"training.check_weight_hash_interval: the data-parallel "
            f"replicas' weights differ after step {step} (Megatron-Core's log names each "
            "parameter). Fix: this is a bug or a hardware fault, not a setting: resume from the "
            "last checkpoint (--load) and report it with the run directory")
    dist.barrier()
    log(f">>> Weight hashes match after {step} iterations...")
