"""Context-parallel core attention on the local (non-TransformerEngine) backend.

Megatron-Core 0.19.2's local `DotProductAttention` asserts `context_parallel_size == 1`;
CP attention in Megatron is TEDotProductAttention's only, and TE is not installed here.
`CPDotProductAttention` is the "all_gather" CP communication type TE also offers
(`cp_comm_type="all_gather"`): each CP rank holds its queries, keys and values for the two
load-balanced chunks Megatron's `get_batch_on_this_cp_rank` gives it (the sequence cut in
2*CP chunks, rank r keeps chunks r and 2CP-1-r). Keys and values are all-gathered over the
CP group (backward: the gradient summed over the group and this rank's slice kept, i.e. a
reduce-scatter written with all-reduce because gloo has no reduce-scatter), put back in
global sequence order, and the local queries attend causally at their global positions.
The rest (scaling, softmax, dropout, GQA) is Megatron's `DotProductAttention.forward`,
called with the causal mask at global positions.

MLA: `CPMLADotProductAttention` is the same on MLA's local core attention (queries and keys
of qk + rope dims, values of v dims; MLA's own RoPE slices its table per CP rank).

Wired: models/specs.py puts it in the `core_attention` slot where CP > 1 and TE is absent;
training/step.py splits batches per CP rank and reduces the loss over CP.
tests/platform/test_context_parallel.py checks it against full-sequence attention on one
rank (forward and gradients); tests/training/test_context_parallel_training.py checks CP=2
training against CP=1.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_mvmoe.layers.local_mla import MLADotProductAttention


class _AllGatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over `group` (rank order); backward sums the gradient over
    the group and returns this rank's slice."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(tensor) for _ in range(group.size())]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad_gathered: torch.Tensor):
        grad_gathered = grad_gathered.contiguous()
        dist.all_reduce(grad_gathered, group=ctx.group)
        return grad_gathered.chunk(ctx.group.size(), dim=0)[ctx.group.rank()], None


def load_balanced_chunk_order(cp_size: int) -> list:
    """Global chunk index of each chunk in rank-order gathered data: rank r holds chunks
    (r, 2CP-1-r)."""
    return [chunk for rank in range(cp_size) for chunk in (rank, 2 * cp_size - 1 - rank)]


def local_positions(seq_len_global: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions of this rank's tokens, in its local order."""
    chunk = seq_len_global // (2 * cp_size)
    firsts = (cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk)
    return torch.cat([torch.arange(first, first + chunk) for first in firsts])


def gather_sequence_in_global_order(tensor_local: torch.Tensor, group) -> torch.Tensor:
    """[s/CP, ...] load-balanced local chunks -> [s, ...] in global sequence order."""
    cp_size = group.size()
    gathered = _AllGatherSequence.apply(tensor_local, group)
    chunks = gathered.chunk(2 * cp_size, dim=0)
    order = load_balanced_chunk_order(cp_size)
    by_global_index = [chunks[order.index(index)] for index in range(2 * cp_size)]
    return torch.cat(by_global_index, dim=0)


class CPDotProductAttention(DotProductAttention):
    """DotProductAttention for CP > 1 ("all_gather" communication type, see module doc)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, **kwargs) -> None:
        if cp_comm_type not in (None, "all_gather"):
            raise ValueError(f"cp_comm_type={cp_comm_type!r}: the local CP attention only "
                             f"does 'all_gather' (set --cp-comm-type all_gather)")
        # Megatron's constructor refuses CP > 1 only because its forward is single-rank;
        # it builds nothing else from the CP size, so it is given a CP=1 view of the config.
        single_rank_config = copy.copy(config)
        single_rank_config.context_parallel_size = 1
        super().__init__(single_rank_config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         pg_collection=pg_collection, **kwargs)
        self.config = config
        if self.scale_mask_softmax.window_size is not None:
            raise ValueError(f"window_size={config.window_size}: the local CP attention has no "
                             f"sliding window (set --context-parallel-size 1)")
        assert getattr(self.pg_collection, "cp", None) is not None, (
            "the CP attention gathers over pg_collection.cp: Megatron's attention passes its "
            "layer's pg_collection (models/specs.py)")
        self.cp_group = self.pg_collection.cp

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        """query [s/CP, b, np, hn], key/value [s/CP, b, ng, hn] (this rank's chunks)."""
        mask_type = attn_mask_type or self.attn_mask_type
        if mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type={mask_type}: the local CP attention is causal "
                             f"only (use --context-parallel-size 1 for other masks)")
        key_global = gather_sequence_in_global_order(key, self.cp_group)
        value_global = gather_sequence_in_global_order(value, self.cp_group)
        masked_q_s = causal_mask_at_global_positions(
            key_global.size(0), self.cp_group.size(), self.cp_group.rank(), query.device)
        return super().forward(query, key_global, value_global, masked_q_s,
                               attn_mask_type=AttnMaskType.arbitrary,
                               attention_bias=attention_bias,
                               packed_seq_params=packed_seq_params)


def causal_mask_at_global_positions(seq_len_global: int, cp_size: int, cp_rank: int,
                                    device) -> torch.Tensor:
    """[1, 1, s/CP, s] bool, True where a local query may not see a key (a later position);
    Megatron's attention_mask_func masks where True."""
    query_positions = local_positions(seq_len_global, cp_size, cp_rank).to(device)
    key_positions = torch.arange(seq_len_global, device=device)
    return (key_positions[None, :] > query_positions[:, None])[None, None]


class CPMLADotProductAttention(CPDotProductAttention, MLADotProductAttention):
    """The CP attention for MLA on the local backend: keys [s/CP, b, np, qk + rope dims] and
    values [s/CP, b, np, v dims] are gathered as any others (the gather is width-blind);
    MLADotProductAttention gives the output its v_channels width (layers/local_mla.py)."""
