"""Megatron-Core 0.19.2 functions that break on CPU tensors, each replaced by one that runs
the original on CUDA tensors and a CPU path otherwise (CPU patches registered in
cpu_patches.PATCHES): the alltoall dispatcher's split sizes, the flex dispatcher's indices
converter, the RoPE table slice per CP rank and CheckpointWithoutOutput's fp8 flag.

A patched function is replaced where it is defined AND in every module that imported it
by name (`patch.rebind`), and its probe calls it through both: patching only an importer left
Megatron's own callers (and its tests) on the original.
"""

from __future__ import annotations

import functools
import importlib

import numpy as np
import torch

from megatron_mvmoe.platform.patch import Patch, rebind


# ------------------------------------------------------------ alltoall split sizes
def _numpy_split_sizes() -> None:
    """The alltoall dispatcher converts split sizes to numpy only for CUDA tensors;
    gloo's all_to_all_single needs plain sizes, so convert CPU tensors too."""
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    original = moe_utils.maybe_move_tensor_to_cpu

    def move_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = move_to_cpu
    dispatcher.maybe_move_tensor_to_cpu = move_to_cpu


def _split_sizes_break() -> bool:
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    out = moe_utils.maybe_move_tensor_to_cpu(torch.zeros(2), as_numpy=True)
    return not isinstance(out, np.ndarray)


# ------------------------------------------------- flex dispatcher's indices converter
def indices_to_multihot_torch(indices_TK, probs_TK, num_local_experts: int):
    """Pure-torch `fused_indices_to_multihot`: indices [T, k] (-1 or >= num_local_experts
    = not local) -> (routing map [T, n] bool, probs [T, n]), differentiable in probs."""
    valid_TK = (indices_TK >= 0) & (indices_TK < num_local_experts)
    safe_TK = torch.where(valid_TK, indices_TK, torch.zeros_like(indices_TK)).long()
    shape = (indices_TK.shape[0], num_local_experts)
    hits = torch.zeros(shape, dtype=torch.int32, device=indices_TK.device)
    hits = hits.scatter_add(1, safe_TK, valid_TK.int())
    probs = torch.zeros(shape, dtype=probs_TK.dtype, device=probs_TK.device)
    probs = probs.scatter_add(1, safe_TK, probs_TK * valid_TK)
    return hits > 0, probs


_INDICES_CONVERTER = "megatron.core.fusions.fused_indices_converter"
# Modules that import `fused_indices_to_multihot` by name (their binding is rebound too).
_INDICES_CONVERTER_USERS = ("megatron.core.transformer.moe.token_dispatcher",)


def _cpu_indices_to_multihot() -> None:
    """The flex dispatcher's `fused_indices_to_multihot` allocates with device='cuda' and
    launches a Triton kernel: on CPU tensors the torch equivalent runs instead."""
    original = importlib.import_module(_INDICES_CONVERTER).fused_indices_to_multihot

    @functools.wraps(original)
    def indices_to_multihot(indices, probs_indices, num_of_local_experts):
        if indices.is_cuda:
            return original(indices, probs_indices, num_of_local_experts)
        return indices_to_multihot_torch(indices, probs_indices, num_of_local_experts)

    indices_to_multihot._mvmoe_wrapped = True
    rebind(_INDICES_CONVERTER, "fused_indices_to_multihot", indices_to_multihot,
           _INDICES_CONVERTER_USERS)


def _indices_to_multihot_breaks() -> bool:
    """Calls the converter as its source module and each importer see it."""
    for module_name in (_INDICES_CONVERTER, *_INDICES_CONVERTER_USERS):
        convert = importlib.import_module(module_name).fused_indices_to_multihot
        try:
            convert(torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1), 2)
        except Exception:  # noqa: BLE001 - CUDA assert, Triton launch error: all mean "breaks"
            return True
    return False


# ---------------------------------------------------- RoPE table slice per CP rank
_ROPE_UTILS = "megatron.core.models.common.embeddings.rope_utils"
_ROPE_UTILS_USERS = ("megatron.core.models.common.embeddings.rotary_pos_embedding",
                     "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")


def _cp_rope_slice_on_cpu() -> None:
    """`get_pos_emb_on_this_cp_rank` builds its chunk index with pin_memory=True and
    .cuda(): on a CPU table the index stays on the table's device (same chunks)."""
    original = importlib.import_module(_ROPE_UTILS).get_pos_emb_on_this_cp_rank

    @functools.wraps(original)
    def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        if pos_emb.is_cuda or cp_group is None:
            return original(pos_emb, seq_dim, cp_group)
        cp_size, cp_rank = cp_group.size(), cp_group.rank()
        cp_idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
        pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1,
                               *pos_emb.shape[seq_dim + 1:])
        pos_emb = pos_emb.index_select(seq_dim, cp_idx)
        return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])

    pos_emb_on_this_cp_rank._mvmoe_wrapped = True
    rebind(_ROPE_UTILS, "get_pos_emb_on_this_cp_rank", pos_emb_on_this_cp_rank,
           _ROPE_UTILS_USERS)


class _TwoRankGroupStandIn:
    """size()/rank() of rank 0 of a 2-rank group: all the slice reads of its group."""

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return 0


def _cp_rope_slice_breaks() -> bool:
    """Calls the slice as its source module and each importer see it."""
    for module_name in (_ROPE_UTILS, *_ROPE_UTILS_USERS):
        slice_for_rank = importlib.import_module(module_name).get_pos_emb_on_this_cp_rank
        try:
            out = slice_for_rank(torch.arange(8.0)[:, None], 0, _TwoRankGroupStandIn())
        except Exception:  # noqa: BLE001 - pin_memory / CUDA init errors all mean "breaks"
            return True
        if out.reshape(-1).tolist() != [0.0, 1.0, 6.0, 7.0]:
            return True
    return False


# ------------------------------------------- CheckpointWithoutOutput's fp8 flag
_RANDOM = "megatron.core.tensor_parallel.random"


def _checkpoint_without_output_fp8_flag() -> None:
    """`CheckpointWithoutOutput.__init__(fp8=False)` sets `self.fp8 = fp8 is not None`, True
    for its own default, so every recompute of a norm, an MoE activation or MLA's up
    projection takes the fp8 branch and calls TransformerEngine's FP8GlobalStateManager
    (never imported without TE: NameError). The argument means "a quantization recipe
    is set" (callers pass config.fp8, a string or None): False and None both mean none."""
    cls = importlib.import_module(_RANDOM).CheckpointWithoutOutput
    original_init = cls.__init__

    def __init__(self, fp8=False):
        original_init(self, fp8)
        self.fp8 = fp8 not in (None, False)

    __init__._mvmoe_wrapped = True
    cls.__init__ = __init__


def _checkpoint_without_output_fp8_breaks() -> bool:
    cls = importlib.import_module(_RANDOM).CheckpointWithoutOutput
    return cls().fp8 and not hasattr(importlib.import_module(_RANDOM), "FP8GlobalStateManager")


INDICES_CONVERTER = Patch(
    "fused_indices_to_multihot on CPU",
    "fusions.fused_indices_converter (imported by the flex dispatcher and by callers "
    "of the fusion) allocates on device='cuda' and launches a Triton kernel.",
    _cpu_indices_to_multihot, _indices_to_multihot_breaks)

CHECKPOINT_FP8_FLAG = Patch(
    "CheckpointWithoutOutput fp8 flag",
    "CheckpointWithoutOutput() (norm, moe_act and MLA up-projection recompute) sets "
    "fp8=True for its default fp8=False and then needs TransformerEngine's "
    "FP8GlobalStateManager: NameError without TE.",
    _checkpoint_without_output_fp8_flag, _checkpoint_without_output_fp8_breaks)

SPLIT_SIZES = Patch(
    "alltoall split sizes",
    "maybe_move_tensor_to_cpu returns numpy only for CUDA tensors; gloo "
    "all_to_all_single rejects CPU tensors as split sizes.",
    _numpy_split_sizes, _split_sizes_break)

CP_ROPE_SLICE = Patch(
    "RoPE slice per CP rank",
    "rope_utils.get_pos_emb_on_this_cp_rank (RotaryEmbedding at CP > 1) builds its "
    "chunk index with pin_memory=True and .cuda().",
    _cp_rope_slice_on_cpu, _cp_rope_slice_breaks)
