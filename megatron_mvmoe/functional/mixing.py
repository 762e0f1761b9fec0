"""View mixing (seed 000, Eq. 4-5): each selected expert sees a convex blend of the K views.
Pure torch.

Legend: T tokens (flattened [S, B] order), E experts, R routing heads (= K views),
S selected slots per token (top-k), L latent size.

Design choices:
- a_{m,i} = s_{m,i} / sum_n s_{n,i}: the heads' RELATIVE preference for expert i, which the
  summed score alone does not keep ((0.4, 0.1) and (0.2, 0.3) both sum to 0.5).
- The blend is formed before the expert, per (token, slot): the expert computes
  E_i(sum_m a_{m,i} v_m), not sum_m a_{m,i} E_i(v_m), and each (token, slot) is still one
  latent row, so the all-to-all volume equals the latent-MoE baseline's.
- Ratios run in fp32. If every head's score underflows to 0 for a selected expert, the blend
  falls back to the uniform 1/R (the weights still sum to 1, no NaN in forward or backward).
"""

from __future__ import annotations

import torch


def mixing_weights(scores_TRE: torch.Tensor, topk_idx_TS: torch.Tensor) -> torch.Tensor:
    """a_{m,i} for the selected experts.

    Args:
        scores_TRE: per-head sigmoid scores [T, R, E] (raw, not summed, not biased).
        topk_idx_TS: selected experts [T, S] (slot order of select_topk).

    Returns:
        mix_TSR [T, S, R] in scores' dtype, each [t, s, :] summing to 1.
    """
    num_tokens, num_heads, _ = scores_TRE.shape
    idx_TRS = topk_idx_TS.unsqueeze(1).expand(num_tokens, num_heads, topk_idx_TS.shape[1])
    selected_TSR = scores_TRE.float().gather(2, idx_TRS).transpose(1, 2)
    total_TS1 = selected_TSR.sum(dim=-1, keepdim=True)
    positive_TS1 = total_TS1 > 0
    safe_total_TS1 = torch.where(positive_TS1, total_TS1, torch.ones_like(total_TS1))
    mix_TSR = torch.where(
        positive_TS1, selected_TSR / safe_total_TS1, torch.full_like(selected_TSR, 1.0 / num_heads)
    )
    return mix_TSR.to(scores_TRE.dtype)


def mix_views(
    views_TRL: torch.Tensor, mix_TSR: torch.Tensor, stop_grad_mixing: bool = False
) -> torch.Tensor:
    """Per-(token, slot) expert inputs v_hat = sum_m a_{m,i} v_m (Eq. 5), one batched GEMM.

    Args:
        views_TRL: the K = R latent views of each token [T, R, L].
        mix_TSR: mixing weights [T, S, R] from mixing_weights.
        stop_grad_mixing: detach mix_TSR (the paper's ablation): no gradient flows from the
            blend back into the routers; the views still get their gradient.

    Returns:
        rows_TSL [T, S, L]: row (t, s) is what the expert of slot s sees for token t.
    """
    if mix_TSR.shape[0] != views_TRL.shape[0] or mix_TSR.shape[2] != views_TRL.shape[1]:
        raise ValueError(
            f"mix_TSR {tuple(mix_TSR.shape)} does not fit views_TRL {tuple(views_TRL.shape)}. "
            "Fix: use one view per routing head (num_views == num_routers) and the same tokens")
    if stop_grad_mixing:
        mix_TSR = mix_TSR.detach()
    return torch.bmm(mix_TSR.to(views_TRL.dtype), views_TRL)


def blend_views(views_TRL: torch.Tensor, mix_TSR: torch.Tensor) -> torch.Tensor:
    """rows_TSL = v_0 + sum_m a_m (v_m - v_0), equal to sum_m a_m v_m (the weights sum to 1).

    At gamma = 0 the differences are exactly zero, so every row is the backbone view P h
    bit for bit (a warm start reproduces the baseline exactly) while every parameter stays
    in the autograd graph. Works for any leading row count (T tokens, or N dispatched rows
    with one slot each)."""
    backbone_T1L = views_TRL[:, :1, :]
    return backbone_T1L + mix_views(views_TRL - backbone_T1L, mix_TSR)


def views_are_cheaper(n, views: int, width: int, dtype_bytes: int, weight_bytes: int):
    """True where K views + n*K weights are strictly smaller than n blended rows (the rule
    the dedup dispatcher applies per (token, destination); ties send blends)."""
    return views * width * dtype_bytes + n * views * weight_bytes < n * width * dtype_bytes
