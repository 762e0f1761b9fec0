"""Per-(token, slot) rows in Megatron's dispatch order (seed 000's Multi-View dispatch).
Pure torch.

Legend: T tokens, E experts, S selected slots per token (ascending expert id), L latent
size, N dispatched rows (T*S, dropless).

Megatron's `permute` transposes the [T, E] routing map and masked-selects an arange of
tokens, so rows run expert by expert (ascending) and, within an expert, token by token
(ascending). Multi-View sends one blended row per (token, slot), so it needs the same order
over (token, slot) pairs: `expert_major_rows` gives it from the selection, `permute_rows`
gathers [T, S, L] rows into it (the per-row dispatcher's permute).
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch


class DispatchRows(NamedTuple):
    """Megatron's expert-major dispatch order written as (token, slot) per output row."""

    row_token_N: torch.Tensor
    """int64 [N]: token of each dispatched row."""
    row_slot_N: torch.Tensor
    """int64 [N]: slot (index into topk_idx_TS[token]) of each dispatched row."""
    tokens_per_expert_E: torch.Tensor
    """int64 [E]: rows per expert (rows are grouped by expert, experts ascending)."""


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


def permute_rows(
    rows_TSL: torch.Tensor, routing_map_TE: torch.Tensor, probs_TE: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row version of Megatron's `permute` (moe_utils.permute, dropless, unfused).

    Returns:
        permuted_NL: rows in Megatron's expert-major order (tokens ascending per expert);
        permuted_probs_N: the gates in the same order (differentiable);
        token_ids_N: the token of each permuted row (Megatron's `sorted_indices`, used by
            the combine's scatter-add).
    """
    num_tokens, num_slots, latent = rows_TSL.shape
    map_ET = routing_map_TE.T.contiguous()
    slot_TE = routing_map_TE.long().cumsum(dim=1) - 1  # s-th True of row t -> slot s
    token_T1 = torch.arange(num_tokens, device=rows_TSL.device).unsqueeze(1)
    row_ids_N = (token_T1 * num_slots + slot_TE).T.masked_select(map_ET)
    token_ids_N = token_T1.T.expand(map_ET.shape).masked_select(map_ET)
    permuted_NL = rows_TSL.reshape(num_tokens * num_slots, latent).index_select(0, row_ids_N)
    permuted_probs_N = probs_TE.T.contiguous().masked_select(map_ET)
    return permuted_NL, permuted_probs_N, token_ids_N


def map_rows(routing_map_TE: torch.Tensor, slot_TE: torch.Tensor) -> DispatchRows:
    """The (token, slot) behind each row of Megatron's permute of ANY routing map: the
    dropless one, one with rows dropped by the expert capacity, or a capacity-padded one
    (Megatron's drop-and-pad permute keeps each expert's C Trues in ascending token order,
    the masked-select order used here). slot_TE is `slots_of_experts`: a pair the token did
    not select (padding) has slot S."""
    with torch.no_grad():
        map_ET = routing_map_TE.T.contiguous()
        num_tokens = routing_map_TE.shape[0]
        token_ET = torch.arange(num_tokens, device=map_ET.device).expand(map_ET.shape)
        return DispatchRows(token_ET.masked_select(map_ET), slot_TE.T.masked_select(map_ET),
                            map_ET.sum(dim=1))
