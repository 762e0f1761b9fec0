"""Pure-torch references for the Multi-View MoE kernels (seed 000, Eq. 2-5, Algorithm 1).

Legend: T tokens (flattened [S, B] order), E experts, R routing heads (= K views),
S selected slots per token (top-k), L latent size, N dispatched rows (T*S without drops).

These are the specification the Triton kernels are tested against; they are autograd
capable and run anywhere. They ARE the project's math (megatron_mvmoe.functional), composed
in fp32:
- scores s = sigmoid(logits) in fp32; summed = sum over heads AFTER the sigmoid;
- selection = top-k of (summed + bias) by a stable descending sort (ties -> lower expert
  id), slots then sorted by ASCENDING expert id; bias never touches gate values;
- gates g = alpha_i * summed_i / max(sum_{j in S} summed_j, eps); with k = 1 the
  normalisation would make every gate alpha (no router gradient), so the gate is
  alpha_i * summed_i / R instead, as the routing module does;
- mix a[t, s, r] = s[t, r, i] / sum_n s[t, n, i] for the selected i, uniform 1/R where
  every head's score underflowed to 0 (no NaN);
- outputs are fp32 (routing precision), whatever the logits' dtype.
Dispatch order is Megatron's permute order: expert-major, tokens ascending within an expert.
"""

from __future__ import annotations

from typing import NamedTuple, Union

import torch

from megatron_mvmoe.functional import gates, mixing_weights, select_topk
from megatron_mvmoe.functional.permute import DispatchRows, expert_major_rows  # noqa: F401


class RouterOutput(NamedTuple):
    """What the fused multi-router step returns (always these four, in this order)."""

    topk_idx_TS: torch.Tensor
    """int64 [T, S]: selected experts, ascending per row; no gradient."""
    gates_TS: torch.Tensor
    """fp32 [T, S]: output gates (Eq. 3), aligned with topk_idx_TS."""
    mix_TSR: torch.Tensor
    """fp32 [T, S, R]: view mixing weights (Eq. 4), each [t, s, :] sums to 1."""
    summed_TE: torch.Tensor
    """fp32 [T, E]: unbiased summed scores (Eq. 2), for balancing losses and statistics."""


def reference_multi_router(
    logits_TRE: torch.Tensor,
    bias_E: torch.Tensor,
    k: int,
    alpha: Union[float, torch.Tensor] = 1.0,
    eps: float = 1e-6,
) -> RouterOutput:
    """Multi-Router selection, gates and Multi-View mixing weights for all tokens.

    Args:
        logits_TRE: logits of the R routing heads [T, R, E].
        bias_E: expert-balancing bias [E], selection only.
        k: experts per token (S).
        alpha: gate scale, a float, a 0-d tensor or per-expert alpha_E [E].
        eps: floor on the selected-score sum (Eq. 3).
    """
    num_heads = logits_TRE.shape[1]
    scores_TRE = torch.sigmoid(logits_TRE.float())
    summed_TE = scores_TRE.sum(dim=1)
    topk_idx_TS = select_topk(summed_TE, bias_E.float(), k)
    alpha = alpha.float() if isinstance(alpha, torch.Tensor) else alpha
    gates_TS = gates(summed_TE, topk_idx_TS, alpha, eps, num_heads)
    mix_TSR = mixing_weights(scores_TRE, topk_idx_TS)
    return RouterOutput(topk_idx_TS, gates_TS, mix_TSR, summed_TE)


def reference_mix_and_permute(
    views_TRL: torch.Tensor,
    mix_TSR: torch.Tensor,
    row_token_N: torch.Tensor,
    row_slot_N: torch.Tensor,
) -> torch.Tensor:
    """Dispatch rows: row n = sum_r mix[t, s, r] * views[t, r, :] with (t, s) = row n's pair.

    Computed in fp32 and returned in views' dtype. Materialises [N, R, L] (a reference).
    """
    # upcast before indexing so the backward's per-token sum also runs in fp32
    mix_NR = mix_TSR.float()[row_token_N, row_slot_N]
    views_NRL = views_TRL.float()[row_token_N]
    return (mix_NR.unsqueeze(-1) * views_NRL).sum(dim=1).to(views_TRL.dtype)
