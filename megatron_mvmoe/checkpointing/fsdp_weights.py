"""The model weights of a Megatron-FSDP checkpoint (--ckpt-format fsdp_dtensor) into unwrapped
GPTModel chunks at any TP / ETP / EP layout: what the tools (evaluate, generate, export,
routing analysis) read.

Such a checkpoint holds, under `model<i>.module.<parameter name>`, each parameter as a whole
DTensor (the global tensor of all tensor-parallel shards, experts under their global index;
training/fsdp_checkpoint.py writes it). Here every rank reads, without collectives, the whole
tensors its parameters need and cuts its own shard:

- a tensor-parallel parameter (Megatron's `tensor_model_parallel` / `partition_dim`) is the
  concatenation of its shards along `partition_dim`, so this rank's is chunk `rank` of
  `size` equal parts (the TP group for dense weights, the expert-TP group for experts);
- SwiGLU's fc1 shard is [w_r; v_r], its halves' shards stacked, so the saved tensor is
  [w_0; v_0; w_1; v_1; ...] at the saved size: both halves are put back together first and
  cut at this layout's size (what Megatron-LM's fsdp_dtensor split of fc1 is for);
- expert `local_experts.<i>` on expert-parallel rank e is global expert
  e x local count + i (Megatron-Core's `handle_experts_in_state_dict`, as the save).
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state
from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict
from torch.distributed.checkpoint import FileSystemReader

from megatron_mvmoe.checkpointing.errors import CheckpointError

GLU_FC1 = re.compile(r"\.mlp\.(experts\.local_experts\.\d+\.|shared_experts\.)?linear_fc1\.weight$")
"""SwiGLU's fused first projection (dense MLP, experts, shared expert)."""


def _shard_group(name: str) -> tuple:
    """(size, rank) of the group a tensor-parallel parameter is split over."""
    if ".mlp.experts." in name:
        return (parallel_state.get_expert_tensor_parallel_world_size(),
                parallel_state.get_expert_tensor_parallel_rank())
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_rank())


def _saved_size(name: str, layout: Dict) -> int:
    """The size of that group when the checkpoint was saved."""
    return (layout.get("etp") or 1) if ".mlp.experts." in name else (layout.get("tp") or 1)


def glu_halves(whole: torch.Tensor, saved_size: int) -> tuple:
    """(w, v), the whole halves of a SwiGLU fc1 saved as [w_0; v_0; w_1; v_1; ...]."""
    blocks = whole.chunk(2 * saved_size, dim=0)
    return torch.cat(blocks[0::2]), torch.cat(blocks[1::2])


def local_shard(name: str, param: torch.Tensor, whole: torch.Tensor, layout: Dict,
                gated: bool) -> torch.Tensor:
    """This rank's part of the saved whole tensor of parameter `name`."""
    if not getattr(param, "tensor_model_parallel", False) or whole.shape == param.shape:
        if gated and GLU_FC1.search(name) and _saved_size(name, layout) > 1:
            return torch.cat(glu_halves(whole, _saved_size(name, layout)))
        return whole
    size, rank = _shard_group(name)
    dim = param.partition_dim
    if gated and GLU_FC1.search(name):
        w, v = glu_halves(whole, _saved_size(name, layout))
        return torch.cat([w.chunk(size, dim=0)[rank], v.chunk(size, dim=0)[rank]])
    return whole.chunk(size, dim=dim)[rank]


def _saved_key(chunk_index: int, name: str, num_experts: Optional[int]) -> str:
    (global_name,) = handle_experts_in_state_dict({name: None}, num_experts)
    return f"model{chunk_index}.module.{global_name}"


def read_fsdp_weights(chunks: List[torch.nn.Module], directory: str,
                      layout: Optional[Dict]) -> None:
    """Fill `chunks` (this rank's unwrapped GPTModel chunks) from the fsdp_dtensor checkpoint
    in `directory`, saved at `layout` (its tp and etp)."""
    saved = FileSystemReader(directory).read_metadata().state_dict_metadata
    config = chunks[0].config
    gated, num_experts = config.gated_linear_unit, config.num_moe_experts
    for i, chunk in enumerate(chunks):
        params = {name: t for name, t in chunk.state_dict(keep_vars=True).items()
                  if isinstance(t, torch.Tensor)}
        keys = {name: _saved_key(i, name, num_experts) for name in params}
        missing = sorted(key for key in keys.values() if key not in saved)
        if missing:
            raise CheckpointError(f"{directory}: the fsdp_dtensor checkpoint has no "
                                  f"{', '.join(missing[:3])} ({len(missing)} missing): it was "
                                  "saved from another model. Fix: load it with the run config "
                                  "stored in it")
        wholes = {key: torch.empty(saved[key].size, dtype=saved[key].properties.dtype)
                  for key in keys.values()}
        dcp.load(wholes, storage_reader=FileSystemReader(directory), no_dist=True)
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(local_shard(name, param, wholes[keys[name]], layout or {}, gated))
