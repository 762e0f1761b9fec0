"""The papers' math in one place, pure torch: it imports neither Megatron nor any other part
of megatron_mvmoe (tests/test_dependency_rules.py enforces it), so routers, layers, the
kernels' references and the analysis tools all compute Eq. 2-5 with the same code.

- routing (seed 000, Eq. 2-3): multi_router_logits, sigmoid_scores, sum_over_routers,
  select_topk, gates, gate_denominator, alpha_for_slots, to_megatron, kept_slots,
  slots_of_experts (capacity: which slots survive, which rows are padding)
- mixing (seed 000, Eq. 4-5): mixing_weights, mix_views, blend_views, views_are_cheaper
- permute: expert_major_rows, permute_rows, map_rows (Megatron's dispatch order for
  (token, slot) rows, dropless or after the expert capacity)
- parity, parity_model (seed 001, Eq. 6-9): MH-MoE FLOPs and parameter parity, whole-model
  counts (pure python)
- diversity (seed 000, router diversity): inter-head rank correlation, top-k overlap,
  mixing entropy (the trainer logs two of them; tools/router_report.py all)
- ranks: average ranks, Pearson / Spearman per row, nanmean (diversity and the analyses)
- quantize (seed 001, BitNet b1.58): ternary_weight, absmax_activation, rms_normalize,
  bitlinear_input, straight-through quantizers
"""

from megatron_mvmoe.functional.mixing import mix_views, mixing_weights
from megatron_mvmoe.functional.routing import (
    alpha_for_slots,
    gate_denominator,
    gates,
    kept_slots,
    multi_router_logits,
    select_topk,
    sigmoid_scores,
    slots_of_experts,
    sum_over_routers,
    to_megatron,
)

__all__ = ["alpha_for_slots", "gate_denominator", "gates", "kept_slots", "mix_views",
           "mixing_weights", "multi_router_logits", "select_topk", "sigmoid_scores",
           "slots_of_experts", "sum_over_routers", "to_megatron"]
