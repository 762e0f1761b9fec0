"""Load balancing for the Multi-Router: expert-bias update rule and auxiliary losses.

Legend: T tokens (flattened [S, B] order), E experts, R routing heads, S sequence length in
`sequence_load_balancing_loss` (B sequences per micro-batch).

Design choices:
- Pure functions on local tensors: no collectives here. Callers pass token counts already
  reduced over the group they balance over (Megatron's finalize_model_grads all-reduces the
  bias counts over TP x CP x DP; the router reduces aux-loss counts over TP x CP).
- The aux losses see what the router really uses: the SUMMED head scores, normalised over the
  experts (for R = 1 this is exactly Megatron's sigmoid `scores_for_aux_loss`), and the
  counts of the routing map that is really dispatched.
- Formulas follow Megatron's `switch_load_balancing_loss_func` and `z_loss_func`, so a
  coefficient tuned for Megatron means the same here.
"""

from __future__ import annotations

from typing import Optional

import torch


def expert_bias_update(
    tokens_per_expert_E: torch.Tensor,
    expert_bias_E: torch.Tensor,
    update_rate: float,
    center: bool = False,
) -> torch.Tensor:
    """Aux-loss-free balancing step: bias += sign(mean_count - count) * rate.

    Underloaded experts get a larger bias, overloaded ones a smaller one. Works on a stack of
    layers too ([..., E]). `center=True` subtracts the mean bias afterwards: selection is
    invariant to a shared offset, and centring stops the biases drifting together.
    Megatron's own rule (finalize_model_grads) is the un-centred one.
    """
    with torch.no_grad():
        counts = tokens_per_expert_E.float()
        mean_count = counts.mean(dim=-1, keepdim=True)
        updated = expert_bias_E + torch.sign(mean_count - counts) * update_rate
        if center:
            updated = updated - updated.mean(dim=-1, keepdim=True)
        return updated


def normalized_summed_scores(summed_TE: torch.Tensor, eps: float = 1e-20) -> torch.Tensor:
    """P(expert | token) for the aux loss: summed head scores over their sum across experts."""
    return summed_TE / (summed_TE.sum(dim=-1, keepdim=True) + eps)


def load_balancing_loss(
    probs_TE: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    total_num_tokens: float,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """Switch-style loss  coeff * E * sum_i f_i P_i  (Megatron's switch_load_balancing_loss_func).

    f_i = tokens_per_expert_i / (topk * T_total), P_i = sum_local probs_i / T_total; used for the
    micro-batch loss (counts of this micro-batch) and the global loss (counts averaged over
    the accumulated micro-batches, reduced over DP too).
    """
    num_experts = probs_TE.shape[-1]
    scale = num_experts * coeff / (topk * total_num_tokens * total_num_tokens)
    return torch.sum(probs_TE.sum(dim=0) * tokens_per_expert_E) * scale


def sequence_load_balancing_loss(
    probs_TE: torch.Tensor,
    tokens_per_seq_expert_BE: torch.Tensor,
    seq_length_total: float,
    batch_size: int,
    topk: int,
    coeff: float,
) -> torch.Tensor:
    """Sequence-level loss: the switch loss of each sequence, averaged over the B sequences.

    probs_TE is in [S_local, B] token order; tokens_per_seq_expert_BE are the per-sequence
    counts (reduced over the ranks that split a sequence); seq_length_total is the full
    sequence length. Equals Megatron's `_apply_seq_aux_loss`.
    """
    num_experts = probs_TE.shape[-1]
    probs_BE = probs_TE.view(-1, batch_size, num_experts).sum(dim=0)
    scale = num_experts * coeff / (topk * seq_length_total * seq_length_total)
    return torch.sum(probs_BE * tokens_per_seq_expert_BE) * scale / batch_size


def z_loss(
    logits_TRE: torch.Tensor, coeff: float, valid_T: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """ST-MoE router z-loss  coeff * mean_{t,r} logsumexp_i(logit_{t,r,i})^2, each head on its own.

    valid_T (bool [T], optional) excludes padding tokens from the mean, as Megatron does.
    """
    squared_TR = torch.square(torch.logsumexp(logits_TRE.float(), dim=-1))
    if valid_T is None:
        return squared_TR.mean() * coeff
    valid_T1 = valid_T.unsqueeze(-1).to(squared_TR.dtype)
    num_valid = (valid_T1.sum() * squared_TR.shape[1]).clamp_min(1.0)
    return (squared_TR * valid_T1).sum() / num_valid * coeff
