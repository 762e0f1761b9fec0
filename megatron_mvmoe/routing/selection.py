"""Top-k selection and output gates (seed 000, Eq. 2-3), and Megatron's (probs, routing_map).

Legend: T tokens (flattened [S, B] order), E experts, S selected slots per token (top-k).

Design choices:
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
    if topk_idx_TS.shape[1] == 1:
        normalised_TS = selected_TS / num_routers if num_routers != 1 else selected_TS
    else:
        normalised_TS = selected_TS / selected_TS.sum(dim=-1, keepdim=True).clamp_min(eps)
    return normalised_TS * _alpha_for_slots(alpha, topk_idx_TS)


def _alpha_for_slots(alpha: Union[float, torch.Tensor], topk_idx_TS: torch.Tensor):
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
