"""The planner's context-parallel term (issue 22): what CP = c changes on one rank, for
Megatron's load-balanced batch split and our all-gather CP core attention
(layers/cp_attention.py, TransformerEngine's cp_comm_type="all_gather" on the local
backend).

Legend: S sequence length, b microbatch, c CP size, tp TP size, D hidden, h attention
heads, g query groups, d head dim (D / h), e bytes per element.

Design choices:
- Tokens: each CP rank holds S/c of every sequence (2 chunks of S/(2c)), so every
  per-token activation, the MoE dispatch and the per-rank FLOPs divide by c. The weights
  and gradients are whole on each CP rank; Megatron's DDP buffers (and so the distributed
  optimizer's shards) span data x context parallel (`intra_dp_cp_group`), so dense
  optimizer state divides over dp * c (PlanTarget.dense_optimizer_ranks); the expert-data-
  parallel group already folds CP in (world / (ep etp pp)).
- Attention keeps the gathered keys and values for its backward: 2 S b (g/tp) d elements
  per layer and microbatch, of which the rank's own S/c were counted already; the extra is
  2 (c-1)/c S b (g/tp) d (`gathered_kv_extra_elements`).
- K/V traffic per layer and microbatch: the forward all-gather brings the other c-1 ranks'
  K and V, 2 (c-1)/c S b (g/tp) d elements received; the backward all-reduces the gathered
  gradients of K and V (gloo has no reduce-scatter), which a ring all-reduce of n elements
  sends 2 (c-1)/c n of: 4 (c-1)/c S b (g/tp) d. A reduce-scatter (NCCL) would send half.
- Attention FLOPs: the local S/c queries attend to all S gathered keys, masked, not
  skipped: 4 (S/c) S D / tp per sequence and layer on each rank, exactly 1/c of the
  non-causal count the planner uses at CP = 1 (plan.flops_per_token: 4 S D per token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict

from megatron_mvmoe.config.model_section import ModelSection

if TYPE_CHECKING:  # annotations only
    from megatron_mvmoe.parallel import ParallelLayout


def local_tokens(m: ModelSection, micro_batch_size: int, layout: ParallelLayout) -> int:
    """Tokens of one microbatch on one rank: S b / (cp tp) (sequence parallel inside TP)."""
    return m.seq_length * micro_batch_size // (layout.cp * layout.tp)


def _kv_elements_per_sequence_position(m: ModelSection, layout: ParallelLayout) -> float:
    """(g / tp) d: one position's keys (or values) on this TP rank."""
    groups = m.num_query_groups or m.num_attention_heads
    return groups / layout.tp * (m.hidden_size // m.num_attention_heads)


def gathered_kv_extra_elements(m: ModelSection, micro_batch_size: int,
                               layout: ParallelLayout) -> float:
    """Elements the CP attention keeps per layer and microbatch beyond the rank's own K/V:
    the other ranks' keys and values, 2 (c-1)/c S b (g/tp) d."""
    c = layout.cp
    return 2 * (c - 1) / c * m.seq_length * micro_batch_size \
        * _kv_elements_per_sequence_position(m, layout)


def cp_attention_correction_elements(m: ModelSection, micro_batch_size: int,
                                     layout: ParallelLayout, flash: bool) -> float:
    """What CP changes in one layer's saved attention tensors beyond the S/c tokens
    (planning.memory.activation_bytes): + the gathered remote K/V; without flash attention the
    softmax output is [b, h/tp, S/c, S], (c-1)/c of the b (h/tp) S^2 counted at CP = 1 less
    (with flash its log-sum-exp is per local token, already divided)."""
    c, S = layout.cp, m.seq_length
    scores_less = 0.0 if flash else (micro_batch_size * m.num_attention_heads / layout.tp
                                     * S * S * (c - 1) / c)
    return gathered_kv_extra_elements(m, micro_batch_size, layout) - scores_less


def kv_bytes_per_layer(m: ModelSection, micro_batch_size: int, layout: ParallelLayout,
                       dtype_bytes: int = 2) -> Dict[str, float]:
    """Bytes one rank moves for one layer and microbatch: the forward K/V all-gather
    (received) and the backward gradient all-reduce (sent, ring)."""
    gathered = gathered_kv_extra_elements(m, micro_batch_size, layout)
    return {"forward_all_gather": gathered * dtype_bytes,
            "backward_all_reduce": 2 * gathered * dtype_bytes}


def attention_flops_per_rank(m: ModelSection, micro_batch_size: int,
                             layout: ParallelLayout) -> float:
    """Forward score + context FLOPs of one layer and microbatch on one rank:
    4 (S/c) S D b / tp (masked positions computed, as the local attention does)."""
    S = m.seq_length
    return 4 * (S / layout.cp) * S * m.hidden_size * micro_batch_size / layout.tp


def context_parallel_report(m: ModelSection, layout: ParallelLayout, micro_batch_size: int,
                            microbatches_per_step: int, dtype_bytes: int = 2) -> Dict[str, float]:
    """The plan's "context_parallel" entry: tokens per rank, K/V traffic per layer and per
    step (forward + backward, every layer of this rank's stage), attention FLOPs per rank."""
    per_layer = kv_bytes_per_layer(m, micro_batch_size, layout, dtype_bytes)
    layers = m.num_layers / layout.pp
    per_step = sum(per_layer.values()) * layers * microbatches_per_step
    attention = attention_flops_per_rank(m, micro_batch_size, layout)
    return {"cp": layout.cp, "tokens_per_rank_per_microbatch": local_tokens(
                m, micro_batch_size, layout),
            "kv_all_gather_bytes_per_layer": per_layer["forward_all_gather"],
            "kv_grad_all_reduce_bytes_per_layer": per_layer["backward_all_reduce"],
            "kv_bytes_per_rank_per_step": float(per_step),
            "attention_forward_flops_per_rank_per_layer": float(attention),
            "attention_train_flops_per_rank_per_step": float(
                3 * attention * layers * microbatches_per_step)}
