"""Pure-torch references for the Multi-View MoE kernels (seed 000, Eq. 2-5, Algorithm 1).

Legend: T tokens (flattened [S, B] order), E experts, R routing heads (= K views),
S selected slots per token (top-k), L latent size, N dispatched rows (T*S without drops).

These are the specification the Triton kernels are tested against; they are autograd
capable and run anywhere. They follow the project's routing/views contracts
(megatron_mvmoe.routing.selection, megatron_mvmoe.views.mixing):
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


class DispatchRows(NamedTuple):
    """Megatron's expert-major dispatch order written as (token, slot) per output row."""

    row_token_N: torch.Tensor
    """int64 [N]: token of each dispatched row."""
    row_slot_N: torch.Tensor
    """int64 [N]: slot (index into topk_idx_TS[token]) of each dispatched row."""
    tokens_per_expert_E: torch.Tensor
    """int64 [E]: rows per expert (rows are grouped by expert, experts ascending)."""


def select_topk_ascending(routing_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k expert ids per row, ties to the lower id, slots sorted ascending. [T, S] int64."""
    with torch.no_grad():
        order_TE = torch.sort(routing_TE, dim=-1, descending=True, stable=True).indices
        return torch.sort(order_TE[:, :k], dim=-1).values


def alpha_for_slots(alpha: Union[float, torch.Tensor], topk_idx_TS: torch.Tensor):
    """alpha as a scalar, or alpha_E gathered at the selected experts -> [T, S]."""
    if isinstance(alpha, torch.Tensor) and alpha.dim() == 1:
        return alpha.float()[topk_idx_TS]
    return alpha.float() if isinstance(alpha, torch.Tensor) else alpha


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
    topk_idx_TS = select_topk_ascending(summed_TE.detach() + bias_E.float(), k)
    selected_TS = summed_TE.gather(1, topk_idx_TS)
    if k == 1:
        normalised_TS = selected_TS / num_heads
    else:
        normalised_TS = selected_TS / selected_TS.sum(dim=-1, keepdim=True).clamp_min(eps)
    gates_TS = normalised_TS * alpha_for_slots(alpha, topk_idx_TS)
    mix_TSR = _mixing_weights(scores_TRE, topk_idx_TS)
    return RouterOutput(topk_idx_TS, gates_TS, mix_TSR, summed_TE)


def _mixing_weights(scores_TRE: torch.Tensor, topk_idx_TS: torch.Tensor) -> torch.Tensor:
    num_tokens, num_heads, _ = scores_TRE.shape
    idx_TRS = topk_idx_TS.unsqueeze(1).expand(num_tokens, num_heads, topk_idx_TS.shape[1])
    selected_TSR = scores_TRE.gather(2, idx_TRS).transpose(1, 2)
    total_TS1 = selected_TSR.sum(dim=-1, keepdim=True)
    positive_TS1 = total_TS1 > 0
    safe_TS1 = torch.where(positive_TS1, total_TS1, torch.ones_like(total_TS1))
    uniform_TSR = torch.full_like(selected_TSR, 1.0 / num_heads)
    return torch.where(positive_TS1, selected_TSR / safe_TS1, uniform_TSR)


def expert_major_rows(topk_idx_TS: torch.Tensor, num_experts: int) -> DispatchRows:
    """The (token, slot) behind each row of Megatron's permute, without dropping.

    Megatron's `permute` transposes the [T, E] routing map and masked-selects an arange of
    tokens, so rows run expert by expert (ascending) and, within an expert, token by token
    (ascending). Each token picks an expert at most once, so (expert, token) keys are unique
    and one sort reproduces that order exactly.
    """
    num_tokens, num_slots = topk_idx_TS.shape
    with torch.no_grad():
        flat_idx = topk_idx_TS.reshape(-1).long()
        token_of_flat = torch.arange(num_tokens, device=flat_idx.device).repeat_interleave(
            num_slots)
        order_N = torch.argsort(flat_idx * num_tokens + token_of_flat)
        tokens_per_expert_E = torch.bincount(flat_idx, minlength=num_experts)
        return DispatchRows(order_N // num_slots, order_N % num_slots, tokens_per_expert_E)


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
