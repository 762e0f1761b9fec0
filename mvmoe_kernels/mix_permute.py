"""Mix-and-permute (seed 000, Eq. 5): blend each token's views per selected expert and write
the blends straight into the expert-major dispatch buffer.

Legend: T tokens (flattened [S, B] order), R views (= routing heads), S selected slots,
L latent size, N dispatched rows.

    rows_NL = mix_and_permute(views_TRL, mix_TSR, row_token_N, row_slot_N)
    rows_NL[n] = sum_r mix_TSR[t, s, r] * views_TRL[t, r, :],  (t, s) = (row_token_N[n],
                                                                      row_slot_N[n])

Design choices:
- The unfused path writes a [T, S, L] blend and then permutes it (another read and write);
  here each blend is written once, into its dispatch row. The (token, slot) per row comes
  from the caller (expert_major_rows gives Megatron's permute order), so any dispatcher
  order works, including capacity drops (N < T*S: unlisted pairs are simply not sent) and
  padding (rows listed nowhere come back as zeros).
- The kernels walk tokens and use the inverse map row_of_TS (built here with one scatter),
  so views are read once per token rather than once per row, and no atomics are needed.
- Backward: d views[t, r] = sum_s mix[t, s, r] d rows[row(t, s)]; d mix[t, s, r] =
  <d rows[row(t, s)], views[t, r]>. Both in one token-major pass.
- Index values are checked on CPU only; on CUDA that would cost a device sync per call,
  so there a bad index is the caller's bug (expert_major_rows never makes one).
"""

from __future__ import annotations

from typing import Optional

import torch

from .backend import KernelLaunch, interpreter_loop_refusal, launch, resolve_backend
from .reference import reference_mix_and_permute

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.int32, torch.int64)


def mix_and_permute(
    views_TRL: torch.Tensor,
    mix_TSR: torch.Tensor,
    row_token_N: torch.Tensor,
    row_slot_N: torch.Tensor,
    *,
    backend: Optional[str] = None,
    num_rows: Optional[int] = None,
) -> torch.Tensor:
    """Dispatch rows of view blends, in the caller's (token, slot) order.

    Args:
        views_TRL: the R latent views of each token [T, R, L] (fp32, bf16 or fp16).
        mix_TSR: mixing weights [T, S, R] (fp32 recommended; any float dtype).
        row_token_N, row_slot_N: int [N], the (token, slot) each output row holds; each pair
            at most once. A token of -1 marks a padding row (returned as zeros); padding
            is only allowed when N != T*S (with N == T*S every pair must be sent).
        backend: "triton", "reference" or "auto"; None reads MVMOE_KERNELS (default auto).
        num_rows: accepted for symmetry with dispatchers; must equal N when given.

    Returns:
        rows_NL [N, L] in views' dtype.
    """
    _validate(views_TRL, mix_TSR, row_token_N, row_slot_N, num_rows)
    if resolve_backend(backend, views_TRL.device) == "reference":
        return _reference_with_padding(views_TRL, mix_TSR, row_token_N, row_slot_N)
    row_of_TS = inverse_rows(row_token_N, row_slot_N, views_TRL.shape[0], mix_TSR.shape[1])
    return _MixAndPermute.apply(views_TRL, mix_TSR, row_of_TS, row_token_N.shape[0])


def inverse_rows(row_token_N: torch.Tensor, row_slot_N: torch.Tensor, num_tokens: int,
                 num_slots: int) -> torch.Tensor:
    """row_of_TS [T, S] int64: the row each (token, slot) goes to, -1 where it is not sent."""
    with torch.no_grad():
        # padding rows scatter into one spare entry that is cut off: no device sync
        spare = num_tokens * num_slots
        row_of = torch.full((spare + 1,), -1, dtype=torch.int64, device=row_token_N.device)
        flat = row_token_N.long() * num_slots + row_slot_N.long()
        flat = torch.where(row_token_N >= 0, flat, torch.full_like(flat, spare))
        row_of.scatter_(0, flat, torch.arange(flat.shape[0], device=flat.device))
        row_of = row_of[:spare]
        return row_of.view(num_tokens, num_slots)


class _MixAndPermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, views_TRL, mix_TSR, row_of_TS, num_rows):
        views_TRL, mix_TSR = views_TRL.contiguous(), mix_TSR.contiguous()
        ctx.save_for_backward(views_TRL, mix_TSR, row_of_TS)
        ctx.num_rows = num_rows
        return mix_permute_forward(views_TRL, mix_TSR, row_of_TS, num_rows)

    @staticmethod
    def backward(ctx, d_rows_NL):
        views_TRL, mix_TSR, row_of_TS = ctx.saved_tensors
        d_views_TRL, d_mix_TSR = mix_permute_backward(views_TRL, mix_TSR, row_of_TS,
                                                      d_rows_NL.contiguous())
        return d_views_TRL, d_mix_TSR, None, None


def mix_permute_forward(views_TRL, mix_TSR, row_of_TS, num_rows: int,
                        block_t: Optional[int] = None, block_l: Optional[int] = None):
    """Launch the forward kernel (no autograd). Tensors contiguous, on one device."""
    num_tokens, _, latent = views_TRL.shape
    any_unsent = num_rows != num_tokens * mix_TSR.shape[1]  # padding rows are never written
    alloc = torch.zeros if any_unsent else torch.empty
    rows_NL = alloc(num_rows, latent, dtype=views_TRL.dtype, device=views_TRL.device)
    if num_tokens > 0 and latent > 0:
        launch(forward_launch(views_TRL, mix_TSR, row_of_TS, rows_NL, block_t, block_l),
               views_TRL.device)
    return rows_NL


def forward_launch(views_TRL, mix_TSR, row_of_TS, rows_NL, block_t: Optional[int] = None,
                   block_l: Optional[int] = None,
                   device_type: Optional[str] = None) -> KernelLaunch:
    """The forward kernel call (T, L >= 1). device_type (default: the views' device) picks
    the block sizes: aot.py passes "cuda" with meta tensors."""
    from . import _mix_permute_triton

    num_tokens, num_views, latent = views_TRL.shape
    block_t, block_l = _block_sizes(num_tokens, num_views, latent,
                                    device_type or views_TRL.device.type, block_t, block_l)
    return KernelLaunch(
        _mix_permute_triton.mix_permute_fwd, (_cdiv(num_tokens, block_t), _cdiv(latent, block_l)),
        (views_TRL, mix_TSR, row_of_TS, rows_NL, num_tokens, latent),
        dict(NUM_VIEWS=num_views, NUM_SLOTS=mix_TSR.shape[1], VIEWS_PAD=_next_pow2(num_views),
             BLOCK_T=block_t, BLOCK_L=block_l))


def mix_permute_backward(views_TRL, mix_TSR, row_of_TS, d_rows_NL,
                         block_t: Optional[int] = None, block_l: Optional[int] = None):
    """Launch the backward kernel. Returns (d_views_TRL, d_mix_TSR) in their inputs' dtypes."""
    num_tokens, _, latent = views_TRL.shape
    d_views_TRL = torch.empty_like(views_TRL)
    d_mix_TSR = torch.empty_like(mix_TSR)
    if num_tokens == 0 or latent == 0:
        return d_views_TRL.zero_(), d_mix_TSR.zero_()
    refusal = None if views_TRL.device.type == "cuda" else interpreter_loop_refusal()
    if refusal:  # the kernel walks the latent row in a loop bounded by L
        raise ValueError(f"mix_permute backward: {refusal}")
    launch(backward_launch(views_TRL, mix_TSR, row_of_TS, d_rows_NL, d_views_TRL, d_mix_TSR,
                           block_t, block_l), views_TRL.device)
    return d_views_TRL, d_mix_TSR


def backward_launch(views_TRL, mix_TSR, row_of_TS, d_rows_NL, d_views_TRL, d_mix_TSR,
                    block_t: Optional[int] = None, block_l: Optional[int] = None,
                    device_type: Optional[str] = None) -> KernelLaunch:
    """The backward kernel call (T, L >= 1); device_type as in forward_launch."""
    from . import _mix_permute_triton

    num_tokens, num_views, latent = views_TRL.shape
    num_slots = mix_TSR.shape[1]
    block_t, block_l = _block_sizes(num_tokens, num_views, latent,
                                    device_type or views_TRL.device.type, block_t, block_l)
    return KernelLaunch(
        _mix_permute_triton.mix_permute_bwd, (_cdiv(num_tokens, block_t),),
        (views_TRL, mix_TSR, row_of_TS, d_rows_NL, d_views_TRL, d_mix_TSR, num_tokens, latent),
        dict(NUM_VIEWS=num_views, NUM_SLOTS=num_slots, VIEWS_PAD=_next_pow2(num_views),
             SLOTS_PAD=_next_pow2(num_slots), BLOCK_T=block_t, BLOCK_L=block_l))


def _reference_with_padding(views_TRL, mix_TSR, row_token_N, row_slot_N):
    sent = row_token_N >= 0
    if bool(sent.all()):
        return reference_mix_and_permute(views_TRL, mix_TSR, row_token_N, row_slot_N)
    rows_NL = views_TRL.new_zeros(row_token_N.shape[0], views_TRL.shape[2])
    sent_rows = reference_mix_and_permute(views_TRL, mix_TSR, row_token_N[sent], row_slot_N[sent])
    return rows_NL.index_copy(0, sent.nonzero().squeeze(1), sent_rows)


def _validate(views_TRL, mix_TSR, row_token_N, row_slot_N, num_rows) -> None:
    if not isinstance(views_TRL, torch.Tensor) or views_TRL.dim() != 3:
        raise ValueError("views_TRL: expected the [T, R, L] latent views. Fix: stack the R "
                         "views of each token along dim 1")
    if not isinstance(mix_TSR, torch.Tensor) or mix_TSR.dim() != 3:
        raise ValueError("mix_TSR: expected [T, S, R] mixing weights (RouterOutput.mix_TSR)")
    for name, x in (("views_TRL", views_TRL), ("mix_TSR", mix_TSR)):
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: dtype {x.dtype} is not supported. "
                             "Fix: float32, bfloat16 or float16")
    num_tokens, num_views, _ = views_TRL.shape
    if mix_TSR.shape[0] != num_tokens or mix_TSR.shape[2] != num_views:
        raise ValueError(
            f"mix_TSR: shape {tuple(mix_TSR.shape)} does not fit views_TRL "
            f"{tuple(views_TRL.shape)} (need [T={num_tokens}, S, R={num_views}]). Fix: one "
            "view per routing head (num_views == num_routers), same tokens")
    for name, idx in (("row_token_N", row_token_N), ("row_slot_N", row_slot_N)):
        if not isinstance(idx, torch.Tensor) or idx.dim() != 1 or idx.dtype not in _INDEX_DTYPES:
            raise ValueError(f"{name}: expected a 1-D int32/int64 tensor, got "
                             f"{getattr(idx, 'dtype', type(idx).__name__)}. "
                             "Fix: use expert_major_rows(topk_idx_TS, E)")
    if row_token_N.shape != row_slot_N.shape:
        raise ValueError(f"row_slot_N: {tuple(row_slot_N.shape)} rows but row_token_N has "
                         f"{tuple(row_token_N.shape)}. Fix: one (token, slot) per row")
    if num_rows is not None and num_rows != row_token_N.shape[0]:
        raise ValueError(f"num_rows: {num_rows} != len(row_token_N) {row_token_N.shape[0]}. "
                         "Fix: list a (token, slot) for every row, -1 tokens for padding")
    for name, x in (("mix_TSR", mix_TSR), ("row_token_N", row_token_N),
                    ("row_slot_N", row_slot_N)):
        if x.device != views_TRL.device:
            raise ValueError(f"{name}: on {x.device} but views_TRL is on {views_TRL.device}. "
                             f"Fix: move it to {views_TRL.device}")
    if views_TRL.device.type == "cpu":
        _check_index_values(row_token_N, row_slot_N, num_tokens, mix_TSR.shape[1])


def _check_index_values(row_token_N, row_slot_N, num_tokens: int, num_slots: int) -> None:
    sent = row_token_N >= 0
    if row_token_N.shape[0] == num_tokens * num_slots and not bool(sent.all()):
        raise ValueError("row_token_N: padding rows (-1) with N == T*S rows; every pair must "
                         "then be sent. Fix: drop the padding rows or send every pair")
    tokens, slots = row_token_N[sent].long(), row_slot_N[sent].long()
    if bool((tokens >= num_tokens).any()) or bool(((slots < 0) | (slots >= num_slots)).any()):
        raise ValueError(f"row_token_N/row_slot_N: indices out of range (T={num_tokens}, "
                         f"S={num_slots}). Fix: build them with expert_major_rows")
    pairs = tokens * num_slots + slots
    if pairs.unique().numel() != pairs.numel():
        raise ValueError("row_token_N/row_slot_N: a (token, slot) pair appears in two rows. "
                         "Fix: each selected pair is dispatched once")


def _block_sizes(num_tokens, num_views, latent, device_type: str, block_t, block_l):
    if block_l is None:
        block_l = min(128, _next_pow2(latent)) if device_type == "cuda" else _next_pow2(latent)
    if block_t is None:
        if device_type == "cuda":  # a [BLOCK_T, R, BLOCK_L] fp32 tile of about 4k elements
            block_t = max(1, min(64, 4096 // (_next_pow2(num_views) * block_l)))
        else:  # the interpreter pays ~2 ms per program: few, large programs
            block_t = min(256, _next_pow2(num_tokens))
    for name, value in (("block_t", block_t), ("block_l", block_l)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name}: {value} must be a power of 2. Fix: 16, 64, ... or None")
    return block_t, block_l


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
