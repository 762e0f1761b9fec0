"""Uneven all-gathers on gloo (a platform patch registered in cpu_patches.ALL_PATCHES, probed
by uneven_gather_breaks).

With expert tensor parallelism over several ranks and expert parallelism (Megatron-LM's
default: ETP = TP), the alltoall dispatcher gathers each TP rank's received tokens with
`gather_from_sequence_parallel_region(..., output_split_sizes=...)`: the ranks hold different
token counts, and Megatron-Core 0.19.2's `_gather_along_first_dim` hands
`torch.distributed.all_gather` a list of unequal tensors, which NCCL takes and gloo refuses
("ProcessGroupGloo::allgather: invalid tensor size"). The patch pads each rank's rows to the
largest count, gathers equal blocks and keeps each block's real rows: the same tensor,
element for element (tests/platform/test_cpu_uneven_gather.py; the reduce-scatter of the
backward takes unequal lists on gloo already)."""

from __future__ import annotations

import importlib
import inspect
from typing import List

import torch
import torch.distributed as dist

_MAPPINGS = "megatron.core.tensor_parallel.mappings"


def gather_uneven_rows(rows: torch.Tensor, group, split_sizes: List[int]) -> torch.Tensor:
    """Every rank's `rows` (split_sizes[r] of them on rank r) concatenated in rank order,
    through one all-gather of equal, padded blocks."""
    most = max(split_sizes)
    padded = rows.new_zeros((most, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    blocks = rows.new_empty((len(split_sizes) * most, *rows.shape[1:]))
    dist.all_gather_into_tensor(blocks, padded.contiguous(), group=group)
    return torch.cat([blocks[r * most: r * most + n] for r, n in enumerate(split_sizes)])


def uneven_gather_on_gloo() -> None:
    mappings = importlib.import_module(_MAPPINGS)
    original = mappings._gather_along_first_dim
    if getattr(original, "_mvmoe_wrapped", False):
        return

    def _gather_along_first_dim(input_, group, output_split_sizes=None,
                                use_global_buffer=False):
        if output_split_sizes is None or group is None or group.size() == 1:
            return original(input_, group, output_split_sizes, use_global_buffer)
        return gather_uneven_rows(input_, group, list(output_split_sizes))

    _gather_along_first_dim.__doc__ = original.__doc__
    _gather_along_first_dim._mvmoe_wrapped = True
    mappings._gather_along_first_dim = _gather_along_first_dim  # called by name in-module


def uneven_gather_breaks() -> bool:
    """Unpatched, the split-size branch still all-gathers a list of unequal tensors (gloo
    refuses it: test_gloo_still_refuses_an_uneven_all_gather shows it on 2 ranks)."""
    gather = importlib.import_module(_MAPPINGS)._gather_along_first_dim
    return "torch.distributed.all_gather(output_tensor_list" in inspect.getsource(gather)


# Layer-wise Muon's legacy path (--no-use-layer-wise-param-layout): after each step every
# data-parallel rank all-gathers the flattened matrices it owns, sizes differing per rank;
# Megatron-Core 0.19.2 relies on NCCL taking a list of unequal tensors, gloo refuses it.
_LAYER_WISE = "megatron.core.optimizer.layer_wise_optimizer"


def all_gather_uneven(tensor_list, tensor, group=None, async_op=False):
    """torch.distributed.all_gather for 1-D tensors of unequal lengths: one all-gather of
    equal, padded blocks, each rank's real elements copied into its slot."""
    sizes = [t.numel() for t in tensor_list]
    if len(set(sizes)) == 1:
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    padded = tensor.new_zeros(max(sizes))
    padded[: tensor.numel()] = tensor.reshape(-1)
    blocks = tensor.new_empty(len(sizes) * padded.numel())
    dist.all_gather_into_tensor(blocks, padded, group=group)
    for slot, block, n in zip(tensor_list, blocks.split(padded.numel()), sizes):
        slot.view(-1).copy_(block[:n])
    return None


class _DistributedWithUnevenAllGather:
    def __getattr__(self, name: str):
        return all_gather_uneven if name == "all_gather" else getattr(dist, name)


class _TorchWithUnevenAllGather:
    """`torch` as the layer-wise optimizer's module sees it (over any earlier CPU proxy)."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        if name == "distributed":
            return _DistributedWithUnevenAllGather()
        return getattr(self._inner, name)


def layer_wise_gather_on_gloo() -> None:
    module = importlib.import_module(_LAYER_WISE)
    if not isinstance(module.torch, _TorchWithUnevenAllGather):
        module.torch = _TorchWithUnevenAllGather(module.torch)


def layer_wise_gather_breaks() -> bool:
    """Unpatched, allgather_params still hands all_gather per-rank buffers of each rank's
    own size (tests/training/test_muon.py trains the legacy path at DP 2)."""
    module = importlib.import_module(_LAYER_WISE)
    source = inspect.getsource(module.LayerWiseDistributedOptimizer.allgather_params)
    return ("torch.distributed.all_gather(gather_list" in source
            and not isinstance(module.torch, _TorchWithUnevenAllGather))
