"""Layout-independent deterministic weights, for comparing one model across layouts.

Each parameter gets a canonical global name (global layer number instead of the
pipeline-local index, global expert id instead of the EP-local one) and its values are
drawn from a generator seeded by that name, at the full unsharded shape, then sliced to
this rank's tensor-parallel shard along Megatron's `partition_dim`. So EP=1, EP=2, TP=2
and PP=2 builds of the same config hold identical global weights.
"""

from __future__ import annotations

import re
import zlib
from typing import Dict, Tuple

import torch
from megatron.core import parallel_state

_LAYER_RE = re.compile(r"(decoder\.layers\.)(\d+)\.")
_EXPERT_RE = re.compile(r"(local_experts\.)(\d+)\.")


def canonical_names(model: torch.nn.Module) -> Dict[str, torch.nn.Parameter]:
    """Map layout-independent parameter names to this rank's parameters."""
    layer_numbers = _global_layer_numbers(model)
    names = {}
    for orig, param in model.named_parameters():
        name = orig.replace("module.", "")
        name = _LAYER_RE.sub(lambda m: f"{m.group(1)}{layer_numbers[int(m.group(2))]}.", name)
        name = _EXPERT_RE.sub(
            lambda m: f"{m.group(1)}{_global_expert(model, orig, int(m.group(2)))}.", name)
        names[name] = param
    return names


def _global_layer_numbers(model: torch.nn.Module) -> Dict[int, int]:
    decoder = _find_attr(model, "decoder")
    if decoder is None:
        return {}
    return {i: layer.layer_number - 1 for i, layer in enumerate(decoder.layers)}


def _find_attr(model: torch.nn.Module, attr: str):
    while model is not None:
        if hasattr(model, attr):
            return getattr(model, attr)
        model = getattr(model, "module", None)
    return None


def _global_expert(model: torch.nn.Module, param_name: str, local_idx: int) -> int:
    local_experts = model.get_submodule(param_name.split("local_experts.")[0] + "local_experts")
    return parallel_state.get_expert_model_parallel_rank() * len(local_experts) + local_idx


def _shard_info(param: torch.nn.Parameter, name: str) -> Tuple[int, int, int]:
    """(partition_dim, rank, size) of the TP sharding of `param`; size 1 if unsharded.

    Experts are recognised by name: Megatron tags expert weights `allreduce=False` only
    when expert parallelism is on, so the attribute cannot tell them apart at EP=1.
    """
    if not getattr(param, "tensor_model_parallel", False):
        return 0, 0, 1
    if ".local_experts." in name or ".experts." in name:
        return (param.partition_dim, parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
    return (param.partition_dim, parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def _full_values(name: str, full_shape, seed: int, std: float) -> torch.Tensor:
    if name.endswith("norm.weight") or name.endswith("layer_norm_weight"):
        return torch.ones(full_shape)
    if name.endswith(".bias") or name.endswith("layer_norm_bias"):
        return torch.zeros(full_shape)
    gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    return torch.randn(full_shape, generator=gen) * std


@torch.no_grad()
def deterministic_init(model: torch.nn.Module, seed: int = 0, std: float = 0.05) -> None:
    """Overwrite every parameter with its layout-independent value."""
    for name, param in canonical_names(model).items():
        dim, rank, size = _shard_info(param, name)
        full_shape = list(param.shape)
        full_shape[dim] *= size
        full = _full_values(name, full_shape, seed, std)
        param.copy_(full.narrow(dim, rank * param.shape[dim], param.shape[dim]))


def local_grads(model: torch.nn.Module) -> Dict[str, Tuple[torch.Tensor, int, int, int]]:
    """Canonical name -> (grad or main_grad, partition_dim, tp rank, tp size)."""
    grads = {}
    for name, param in canonical_names(model).items():
        grad = getattr(param, "main_grad", None)
        if grad is None:
            grad = param.grad
        if grad is not None:
            grads[name] = (grad.detach().clone().float(),) + _shard_info(param, name)
    return grads


def merge_rank_grads(per_rank: list) -> Dict[str, torch.Tensor]:
    """Rebuild full gradients from every rank's `local_grads` (TP shards concatenated)."""
    shards: Dict[str, dict] = {}
    for rank_grads in per_rank:
        for name, (grad, dim, rank, size) in rank_grads.items():
            shards.setdefault(name, {})[rank] = (grad, dim, size)
    full = {}
    for name, by_rank in shards.items():
        grad, dim, size = next(iter(by_rank.values()))
        if size == 1:
            full[name] = grad
        else:
            full[name] = torch.cat([by_rank[r][0] for r in range(size)], dim=dim)
    return full
