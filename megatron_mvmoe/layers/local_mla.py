"""Megatron-Core's MLA on its local (non-TransformerEngine) backend: two fixes, as
subclasses slotted in by models/specs.py.

1. `MLADotProductAttention`: `MultiLatentAttention` builds its core attention with
   `k_channels=q_head_dim` and `v_channels=v_head_dim`. TE's attention takes both;
   Megatron-Core 0.19.2's local `DotProductAttention` takes neither (TypeError at build:
   Megatron-LM issue 1589, fix proposed in PR 6564). The scores never need the key width
   (the tensors carry it; MLA passes its own softmax scale); only the output reshape does:
   it must be `v_channels * heads per TP rank` wide, not `kv_channels * heads`.
2. `LocalMLASelfAttention`: with TP > 1 the local down projection is a ColumnParallelLinear
   whose output is gathered over TP inside MLA; the RoPE part of the keys (`k_pos_emb`,
   shared by all heads) then stays a full-sequence tensor that each TP rank uses with its
   own heads, and its gradient (a partial sum per rank) is split, never summed: the
   down-projection gradients come out wrong (measured: 1e-3 off at TP=2). TE's path
   ("duplicated" down projections) keeps the sequence-parallel layout and gathers
   `k_pos_emb` with `gather_from_sequence_parallel_region`, whose backward reduce-scatters,
   i.e. sums. We hand MLA the same layout: the gathered projection scattered back to this
   rank's sequence slice, so Megatron's own code takes that path.

Everything else is Megatron's. tests/layers/test_mla_qk_norm.py checks both: TP=2 x EP=2
equals one rank, and Megatron's local class still refuses `k_channels` (when it stops, fix
1 can go).
"""

from __future__ import annotations

from typing import Optional

from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                    scatter_to_sequence_parallel_region)
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.utils import divide


class MLADotProductAttention(DotProductAttention):
    """DotProductAttention whose output is `v_channels` wide per head."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None) -> None:
        assert softmax_scale is not None or k_channels is None, \
            "MLA passes its own softmax scale (the default would use kv_channels)"
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        if v_channels is not None:
            heads_per_rank = divide(config.num_attention_heads, self.tp_group.size())
            self.hidden_size_per_partition = v_channels * heads_per_rank


class LocalMLASelfAttention(MLASelfAttention):
    """MLASelfAttention whose kv down projection reaches MLA in the sequence-parallel
    layout (`[s / TP, b, kv_lora_rank + qk_pos_emb_head_dim]`), as TE's does."""

    def _qkv_down_projection(self, hidden_states):
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        width = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        if kv_combined.size(-1) != width:  # [s, b, width / TP]: the TP-sharded columns
            assert self.config.sequence_parallel, "TP > 1 runs with sequence parallelism"
            kv_combined = gather_from_tensor_model_parallel_region(kv_combined, self.tp_group)
            kv_combined = scatter_to_sequence_parallel_region(kv_combined, self.tp_group)
        return q_compressed, kv_combined
