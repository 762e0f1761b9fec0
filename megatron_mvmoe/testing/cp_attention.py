"""A tiny CPDotProductAttention on this rank of a CP = world group, for the CP attention
tests (layers/cp_attention.py) and the planner's counted K/V traffic."""

from __future__ import annotations

from typing import Tuple

from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from megatron_mvmoe.layers.cp_attention import CPDotProductAttention
from megatron_mvmoe.layers.sdpa_attention import CPSDPADotProductAttention
from megatron_mvmoe.platform import seed_all


def cp_attention_on_this_rank(cp_size: int, heads: int, groups: int, head_dim: int,
                              sdpa: bool = False
                              ) -> Tuple[CPDotProductAttention, ProcessGroupCollection]:
    """Megatron's groups with CP = `cp_size` and a causal GQA core attention (no dropout,
    softmax in the input dtype) on them; `sdpa`: its torch-SDPA form
    (layers/sdpa_attention.py)."""
    parallel_state.initialize_model_parallel(context_parallel_size=cp_size)
    seed_all(0)  # Megatron's RNG tracker (attention dropout forks it; dropout is 0 here)
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim,
                               num_attention_heads=heads, num_query_groups=groups,
                               kv_channels=head_dim, context_parallel_size=cp_size,
                               attention_softmax_in_fp32=False, masked_softmax_fusion=False,
                               attention_dropout=0.0)
    core = CPSDPADotProductAttention if sdpa else CPDotProductAttention
    attention = core(config, 1, AttnMaskType.causal, "self",
                                      cp_comm_type="all_gather", pg_collection=pgs)
    return attention, pgs
