"""Multi-Router scores (seed 000, Eq. 2): R sigmoid routing heads, summed AFTER the sigmoid.

Legend: T tokens (flattened [S, B] order), D hidden size, E experts, R routing heads.

Design choices:
- The R heads are stored as one weight [R*E, D] (head-major: rows r*E .. r*E+E-1 are head r),
  so all heads cost ONE GEMM; with R = 1 the layout is exactly Megatron's TopKRouter.weight
  [E, D], so baseline router weights copy over unchanged.
- The sigmoid runs in fp32 and is cast back to the logits' dtype, as Megatron's sigmoid
  routing does, so R = 1 reproduces Megatron bit for bit in fp32.
- Summation over heads happens after the sigmoid. Summing logits first would collapse the
  heads into one linear scorer: sum_r w_r^T h = (sum_r w_r)^T h.
"""

from __future__ import annotations

from typing import Optional

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
