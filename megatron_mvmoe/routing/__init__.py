"""Multi-Router routing (seed 000, Eq. 2-3): the Megatron router and balancing; the scores,
selection and gates themselves live in megatron_mvmoe.functional (re-exported here).

Public API (legend: T tokens, D hidden, E experts, R routing heads, S slots = top-k):
- multi_router_logits(hidden_TD, weight_RED, dtype=None) -> logits_TRE   (one GEMM)
- sigmoid_scores(logits_TRE) -> scores_TRE;  sum_over_routers(scores_TRE) -> summed_TE
- select_topk(summed_TE, bias_E, k) -> topk_idx_TS   (slots ascending by expert id)
- gates(summed_TE, topk_idx_TS, alpha, eps, num_routers=1) -> gates_TS
- to_megatron(gates_TS, topk_idx_TS, E) -> (probs_TE, routing_map_TE)
- MultiRouter(config, pg_collection=None): Megatron router (weight [R*E, D], expert_bias [E]);
  route(hidden, padding_mask=None) -> RoutingOutput; forward(...) -> (probs_TE, routing_map_TE)
- balancing: expert_bias_update, normalized_summed_scores, load_balancing_loss,
  sequence_load_balancing_loss, z_loss
"""

from megatron_mvmoe.routing.balancing import (
    expert_bias_update,
    load_balancing_loss,
    normalized_summed_scores,
    sequence_load_balancing_loss,
    z_loss,
)
from megatron_mvmoe.functional.routing import (gates, multi_router_logits, select_topk,
                                               sigmoid_scores, sum_over_routers, to_megatron)
from megatron_mvmoe.routing.router import MultiRouter, RoutingOutput

__all__ = [
    "MultiRouter", "RoutingOutput", "expert_bias_update", "gates", "load_balancing_loss",
    "multi_router_logits",
    "normalized_summed_scores", "select_topk", "sequence_load_balancing_loss",
    "sigmoid_scores", "sum_over_routers", "to_megatron", "z_loss",
]
