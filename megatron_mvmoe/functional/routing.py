"""Multi-Router math (seed 000, Eq. 2-3): head logits and scores, top-k selection, output
gates, and Megatron's (probs, routing_map). Pure torch.

Legend: T tokens (flattened [S, B] order), D hidden size, E experts, R routing heads,
S selected slots per token (top-k).

Design choices:
- The R heads are stored as one weight [R*E, D] (head-major: rows r*E .. r*E+E-1 are head r),
  so all heads cost ONE GEMM; with R = 1 the layout is exactly Megatron's TopKRouter.weight
  [E, D], so baseline router weights copy over unchanged.
- The sigmoid runs in fp32 and is cast back to the logits' dtype, as Megatron's sigmoid
  routing does, so R = 1 reproduces Megatron bit for bit in fp32.
- Summation over heads happens after the sigmoid. Summing logits first would collapse the
  heads into one linear scorer: sum_r w_r^T h = (sum_r w_r)^T h.
- Selection uses summed + bias; the bias only decides WHICH experts, never the gate values,
  which come from the unbiased sums (Eq. 3).
- Ties are broken deterministically by the lower expert id (a stable descending sort),
  so the same scores always select the same experts on every device and kernel.
- Contract: the S slots of a token are sorted by ASCENDING expert id, so slot s of token t is
  the s-th True of routing_map row t. Dispatchers that build per-(token, slot) rows rely on it.
- The gate normaliser is floored at eps (not Megatron's + 1e-20): a sigmoid router could
  otherwise shrink all its scores without changing the gates (Megatron-LM issue 1545).
- With one slot (k = 1) Eq. 3 makes every gate alpha, which leaves the routers with no gradient
  from the task loss; like Megatron (which skips the normalisation at k = 1), the gate is then
  alpha * s_bar_i / R, the mean head score, equal to Megatron's sigmoid score when R = 1.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

def multi_router_logits(
    hidden_TD: torch.Tensor, weight_RED: torch.Tensor, dtype: Optional[torch.dtype] = None
) -> torch.Tensor:
    """Logits of all R heads with one GEMM.

    Args:
        hidden_TD: token hidden states [T, D].
        weight_RED: head weights [R, E, D]; pass `weight_RE_D.view(R, E, D)` of a [R*E, D]
            parameter (a free view: the GEMM runs on the [R*E, D] storage).
        dtype: compute dtype (Megatron's `moe_router_dtype`); None keeps hidden_TD's dtype.

    Returns:
        logits_TRE [T, R, E].
    """
    num_heads, num_experts, hidden = weight_RED.shape
    if hidden_TD.shape[-1] != hidden:
        raise ValueError(
            f"hidden_TD: last dim {hidden_TD.shape[-1]} does not match the router weight's "
            f"hidden size {hidden}. Fix: pass [T, hidden_size] states")
    dtype = hidden_TD.dtype if dtype is None else dtype
    weight_XD = weight_RED.reshape(num_heads * num_experts, hidden)  # X = R*E
    logits_TX = torch.mm(hidden_TD.to(dtype), weight_XD.to(dtype).t())
    return logits_TX.view(hidden_TD.shape[0], num_heads, num_experts)


def sigmoid_scores(logits_TRE: torch.Tensor) -> torch.Tensor:
    """Per-head scores s_{r,i} = sigmoid(logit), computed in fp32, returned in logits' dtype."""
    return torch.sigmoid(logits_TRE.float()).type_as(logits_TRE)


def sum_over_routers(scores_TRE: torch.Tensor) -> torch.Tensor:
    """Summed scores s_bar_i = sum_r s_{r,i} [T, E] (Eq. 2), after the sigmoid.

    With R = 1 this is a view-free squeeze, so R = 1 stays bit-identical to one router.
    """
    if scores_TRE.shape[1] == 1:
        return scores_TRE[:, 0, :]
    return scores_TRE.sum(dim=1)



def select_topk(
    summed_TE: torch.Tensor, bias_E: Optional[torch.Tensor], k: int
) -> torch.Tensor:
    """Experts chosen on summed + bias, slots sorted by ascending expert id.

    Args:
        summed_TE: summed head scores [T, E].
        bias_E: expert-balancing bias [E] (selection only) or None.
        k: experts per token.

    Returns:
        topk_idx_TS [T, S=k] int64, each row ascending; no gradient.
    """
    num_experts = summed_TE.shape[-1]
    if not 1 <= k <= num_experts:
        raise ValueError(f"k: top-k {k} must be in [1, {num_experts}]. Fix: lower moe_router_topk")
    with torch.no_grad():
        routing_TE = summed_TE if bias_E is None else summed_TE + bias_E
        # stable sort: among equal values the lower expert id comes first
        order_TE = torch.sort(routing_TE, dim=-1, descending=True, stable=True).indices
        return torch.sort(order_TE[:, :k], dim=-1).values


def gates(
    summed_TE: torch.Tensor,
    topk_idx_TS: torch.Tensor,
    alpha: Union[float, torch.Tensor],
    eps: float,
    num_routers: int = 1,
) -> torch.Tensor:
    """Output gates g_i = alpha_i * s_bar_i / max(sum_{j in S} s_bar_j, eps) (Eq. 3).

    Args:
        summed_TE: UNBIASED summed scores [T, E] (gradient flows to the routers through it).
        topk_idx_TS: selected experts [T, S].
        alpha: scalar, or per-expert scales alpha_E [E] (may be a learned parameter).
        eps: floor on the selected-score sum.
        num_routers: R, used only when S = 1 (gate = alpha * s_bar / R, see module docstring).

    Returns:
        gates_TS [T, S], aligned with topk_idx_TS.
    """
    selected_TS = summed_TE.gather(1, topk_idx_TS)
    normalised_TS = selected_TS / gate_denominator(summed_TE, topk_idx_TS, eps, num_routers)
    return normalised_TS * alpha_for_slots(alpha, topk_idx_TS)


def gate_denominator(summed_TE: torch.Tensor, topk_idx_TS: torch.Tensor, eps: float,
                     num_routers: int = 1) -> Union[torch.Tensor, int]:
    """What Eq. 3 divides a summed score by: max(sum_{j in S} s_bar_j, eps) [T, 1], or R
    when S = 1 (see the module docstring). Dividing by 1 leaves a float unchanged, so R = 1
    stays bit-identical to the undivided score."""
    if topk_idx_TS.shape[1] == 1:
        return num_routers
    return summed_TE.gather(1, topk_idx_TS).sum(dim=-1, keepdim=True).clamp_min(eps)


def alpha_for_slots(alpha: Union[float, torch.Tensor], topk_idx_TS: torch.Tensor):
    """alpha as a scalar, or alpha_E gathered at the selected experts -> [T, S]."""
    if isinstance(alpha, torch.Tensor) and alpha.dim() == 1:
        return alpha[topk_idx_TS]
    return alpha


def to_megatron(
    gates_TS: torch.Tensor, topk_idx_TS: torch.Tensor, num_experts: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Megatron's router outputs from the slot form.

    Returns:
        probs_TE: gates scattered into [T, E], zero off the selection (these ARE the gates
            Megatron's experts apply), differentiable w.r.t. gates_TS.
        routing_map_TE: bool [T, E], k Trues per row.
    """
    num_tokens = gates_TS.shape[0]
    probs_TE = gates_TS.new_zeros(num_tokens, num_experts).scatter(1, topk_idx_TS, gates_TS)
    routing_map_TE = torch.zeros(
        num_tokens, num_experts, dtype=torch.bool, device=gates_TS.device
    ).scatter(1, topk_idx_TS, True)
    return probs_TE, routing_map_TE


def kept_slots(routing_map_TE: torch.Tensor, topk_idx_TS: torch.Tensor) -> torch.Tensor:
    """bool [T, S]: whether slot s of token t (expert topk_idx_TS[t, s]) is still in the
    routing map after the expert capacity dropped rows from it."""
    return routing_map_TE.gather(1, topk_idx_TS)


def slots_of_experts(topk_idx_TS: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [T, E]: the slot s with topk_idx_TS[t, s] == e, and S ("no slot") where token t
    did not select expert e (a row a capacity-padded routing map adds)."""
    num_tokens, num_slots = topk_idx_TS.shape
    slot_TE = torch.full((num_tokens, num_experts), num_slots, dtype=torch.long,
                         device=topk_idx_TS.device)
    slot_ids_TS = torch.arange(num_slots, device=topk_idx_TS.device).expand(num_tokens, -1)
    return slot_TE.scatter(1, topk_idx_TS.long(), slot_ids_TS)
