"""Fused Multi-Router scoring (seed 000, Eq. 2-4): one pass from logits to slots, gates, mix.

Legend: T tokens (flattened [S, B] order), E experts, R routing heads (= K views),
S selected slots per token (top-k).

    fused_multi_router(logits_TRE, bias_E, k, alpha, eps) -> RouterOutput(
        topk_idx_TS, gates_TS, mix_TSR, summed_TE)

Design choices:
- Unfused, the step reads the [T, R, E] logits, writes and re-reads [T, R, E] scores, a
  [T, E] sum, a biased copy, a sort, then gathers; fused, the forward reads the logits once
  (plus S*R gathered logits per token) and writes only the outputs. The backward reads the
  logits once more and writes their gradient, also in one pass: the scores are recomputed
  from the logits rather than stored (R*E per token is more than the outputs).
- The maths matches reference.py (the project's routing/views contracts) exactly,
  including ties to the lower expert id, the k = 1 gate rule and the uniform-mix fallback.
- Outputs are fp32 whatever the logits' dtype; the logits' gradient comes back in their dtype.
- alpha is a float, a 0-d tensor or alpha_E [E]; a tensor that requires grad gets one (the
  kernel writes per-slot terms, summed per expert by index_add: deterministic, no atomics).
- The bias gets no gradient: it only decides the selection (Eq. 2).
- Kernel bodies live in _routing_triton.py and are decorated at first use (backend.py).
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .backend import KernelLaunch, launch, resolve_backend
from .reference import RouterOutput, reference_multi_router

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fused_multi_router(
    logits_TRE: torch.Tensor,
    bias_E: Optional[torch.Tensor],
    k: int,
    alpha: Union[float, torch.Tensor] = 1.0,
    eps: float = 1e-6,
    *,
    backend: Optional[str] = None,
    block_t: Optional[int] = None,
) -> RouterOutput:
    """Selection, gates, mixing weights and summed scores of R sigmoid routing heads.

    Args:
        logits_TRE: logits of the R heads [T, R, E] (fp32, bf16 or fp16).
        bias_E: expert-balancing bias [E] (selection only), or None for no bias.
        k: experts per token (S), 1 <= k <= E.
        alpha: gate scale: float, 0-d tensor or alpha_E [E].
        eps: floor on the selected-score sum (Eq. 3), > 0.
        backend: "triton", "reference" or "auto"; None reads MVMOE_KERNELS (default auto).
        block_t: tokens per Triton program (power of 2); None picks one for the device.
    """
    num_experts = _validate_router_inputs(logits_TRE, bias_E, k, alpha, eps)
    if bias_E is None:
        bias_E = logits_TRE.new_zeros(num_experts, dtype=torch.float32)
    if resolve_backend(backend, logits_TRE.device) == "reference":
        return reference_multi_router(logits_TRE, bias_E, k, alpha, eps)
    alpha_E = _alpha_vector(alpha, num_experts, logits_TRE.device)
    outputs = _FusedMultiRouter.apply(logits_TRE, bias_E, alpha_E, k, eps, block_t)
    return RouterOutput(*outputs)


class _FusedMultiRouter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TRE, bias_E, alpha_E, k, eps, block_t):
        logits_TRE = logits_TRE.contiguous()
        out = multi_router_forward(logits_TRE, bias_E, alpha_E, k, eps, block_t)
        ctx.save_for_backward(logits_TRE, alpha_E, out.topk_idx_TS, out.gates_TS, out.mix_TSR,
                              out.summed_TE)
        ctx.eps, ctx.block_t = eps, block_t
        ctx.mark_non_differentiable(out.topk_idx_TS)
        ctx.set_materialize_grads(False)
        return tuple(out)

    @staticmethod
    def backward(ctx, _d_idx, d_gates_TS, d_mix_TSR, d_summed_TE):
        logits_TRE, alpha_E, topk_idx_TS, gates_TS, mix_TSR, summed_TE = ctx.saved_tensors
        needs_dalpha = ctx.needs_input_grad[2]
        d_logits_TRE, d_alpha_TS = multi_router_backward(
            logits_TRE, alpha_E, topk_idx_TS, gates_TS, mix_TSR, summed_TE,
            d_gates_TS, d_mix_TSR, d_summed_TE, ctx.eps, needs_dalpha, ctx.block_t)
        d_alpha_E = None
        if needs_dalpha:
            d_alpha_E = torch.zeros_like(alpha_E).index_add_(
                0, topk_idx_TS.reshape(-1), d_alpha_TS.reshape(-1))
        return d_logits_TRE, None, d_alpha_E, None, None, None


def multi_router_forward(
    logits_TRE: torch.Tensor,
    bias_E: torch.Tensor,
    alpha_E: torch.Tensor,
    k: int,
    eps: float,
    block_t: Optional[int] = None,
) -> RouterOutput:
    """Launch the forward kernel (no autograd). Tensors must be contiguous, on one device."""
    num_tokens, num_heads, num_experts = logits_TRE.shape
    _require_same_device(logits_TRE, bias_E=bias_E, alpha_E=alpha_E)
    f32 = dict(dtype=torch.float32, device=logits_TRE.device)
    out = RouterOutput(
        topk_idx_TS=torch.empty(num_tokens, k, dtype=torch.int64, device=logits_TRE.device),
        gates_TS=torch.empty(num_tokens, k, **f32),
        mix_TSR=torch.empty(num_tokens, k, num_heads, **f32),
        summed_TE=torch.empty(num_tokens, num_experts, **f32),
    )
    if num_tokens == 0:
        return out
    launch(forward_launch(logits_TRE, bias_E.contiguous(), alpha_E.contiguous(), out, eps,
                          block_t), logits_TRE.device)
    return out


def forward_launch(logits_TRE, bias_E, alpha_E, out: RouterOutput, eps: float,
                   block_t: Optional[int] = None,
                   device_type: Optional[str] = None) -> KernelLaunch:
    """The forward kernel call on these tensors (T >= 1). device_type (default: the logits'
    device) picks the block sizes: aot.py passes "cuda" with meta tensors."""
    from . import _routing_triton

    num_tokens, num_heads, num_experts = logits_TRE.shape
    block_t, block_e = _block_sizes(num_tokens, num_experts,
                                    device_type or logits_TRE.device.type, block_t)
    return KernelLaunch(
        _routing_triton.multi_router_fwd, (_cdiv(num_tokens, block_t),),
        (logits_TRE, bias_E, alpha_E, *out, num_tokens, num_experts, float(eps)),
        dict(NUM_HEADS=num_heads, NUM_SLOTS=out.topk_idx_TS.shape[1], BLOCK_T=block_t,
             BLOCK_E=block_e))


def multi_router_backward(
    logits_TRE, alpha_E, topk_idx_TS, gates_TS, mix_TSR, summed_TE,
    d_gates_TS: Optional[torch.Tensor],
    d_mix_TSR: Optional[torch.Tensor],
    d_summed_TE: Optional[torch.Tensor],
    eps: float,
    needs_dalpha: bool,
    block_t: Optional[int] = None,
):
    """Launch the backward kernel. Returns (d_logits_TRE, d_alpha_TS or None).

    None upstream gradients count as zero; d_summed_TE None skips its [T, E] read.
    """
    d_gates_TS = _f32_or_zeros(d_gates_TS, gates_TS)
    d_mix_TSR = _f32_or_zeros(d_mix_TSR, mix_TSR)
    d_summed_TE = None if d_summed_TE is None else d_summed_TE.float().contiguous()
    d_logits_TRE = torch.empty_like(logits_TRE)
    d_alpha_TS = torch.empty_like(gates_TS) if needs_dalpha else None
    if logits_TRE.shape[0] > 0:
        launch(backward_launch(logits_TRE, alpha_E, topk_idx_TS, gates_TS, mix_TSR, summed_TE,
                               d_gates_TS, d_mix_TSR, d_summed_TE, d_logits_TRE, d_alpha_TS,
                               eps, block_t), logits_TRE.device)
    return d_logits_TRE, d_alpha_TS


def backward_launch(logits_TRE, alpha_E, topk_idx_TS, gates_TS, mix_TSR, summed_TE,
                    d_gates_TS, d_mix_TSR, d_summed_TE: Optional[torch.Tensor], d_logits_TRE,
                    d_alpha_TS: Optional[torch.Tensor], eps: float,
                    block_t: Optional[int] = None,
                    device_type: Optional[str] = None) -> KernelLaunch:
    """The backward kernel call (T >= 1); d_summed_TE / d_alpha_TS None: not read / written
    (a placeholder pointer is passed). device_type as in forward_launch."""
    from . import _routing_triton

    num_tokens, num_heads, num_experts = logits_TRE.shape
    block_t, block_e = _block_sizes(num_tokens, num_experts,
                                    device_type or logits_TRE.device.type, block_t)
    has_dsummed, needs_dalpha = d_summed_TE is not None, d_alpha_TS is not None
    return KernelLaunch(
        _routing_triton.multi_router_bwd, (_cdiv(num_tokens, block_t),),
        (logits_TRE, alpha_E, topk_idx_TS, gates_TS, mix_TSR, summed_TE,
         d_gates_TS, d_mix_TSR, d_summed_TE if has_dsummed else summed_TE,  # unread
         d_logits_TRE, d_alpha_TS if needs_dalpha else gates_TS,  # unwritten
         num_tokens, num_experts, float(eps)),
        dict(NUM_HEADS=num_heads, NUM_SLOTS=topk_idx_TS.shape[1], HAS_DSUMMED=has_dsummed,
             NEEDS_DALPHA=needs_dalpha, BLOCK_T=block_t, BLOCK_E=block_e))


def _validate_router_inputs(logits_TRE, bias_E, k, alpha, eps) -> int:
    if not isinstance(logits_TRE, torch.Tensor) or logits_TRE.dim() != 3:
        raise ValueError(
            "logits_TRE: expected a [T, R, E] tensor of all routing heads' logits, got "
            f"{_describe(logits_TRE)}. Fix: view [T, R*E] logits as [T, R, E]")
    if logits_TRE.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"logits_TRE: dtype {logits_TRE.dtype} is not supported. "
                         "Fix: pass float32, bfloat16 or float16 logits")
    num_tokens, num_heads, num_experts = logits_TRE.shape
    if num_heads < 1 or num_experts < 1:
        raise ValueError(f"logits_TRE: shape {tuple(logits_TRE.shape)} has no heads or experts. "
                         "Fix: R >= 1 and E >= 1")
    if bias_E is not None:
        if bias_E.shape != (num_experts,):
            raise ValueError(f"bias_E: shape {tuple(bias_E.shape)} should be ({num_experts},), "
                             "one bias per expert. Fix: pass the expert-bias buffer [E]")
        _require_same_device(logits_TRE, bias_E=bias_E)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
        raise ValueError(f"k: top-k {k!r} must be an int in [1, {num_experts}]. "
                         "Fix: lower moe_router_topk or add experts")
    if not eps > 0:
        raise ValueError(f"eps: must be > 0, got {eps}. Fix: use 1e-6")
    if isinstance(alpha, torch.Tensor):
        if alpha.dim() > 1 or (alpha.dim() == 1 and alpha.shape[0] != num_experts):
            raise ValueError(f"alpha: shape {tuple(alpha.shape)} should be () or "
                             f"({num_experts},). Fix: a scalar or one scale per expert")
        _require_same_device(logits_TRE, alpha=alpha)
    elif not isinstance(alpha, (int, float)):
        raise ValueError(f"alpha: expected a float or tensor, got {type(alpha).__name__}")
    return num_experts


def _alpha_vector(alpha, num_experts: int, device: torch.device) -> torch.Tensor:
    """alpha as an fp32 [E] vector; differentiable back to a tensor alpha."""
    if isinstance(alpha, torch.Tensor):
        return alpha.float().expand(num_experts).contiguous()
    return torch.full((num_experts,), float(alpha), dtype=torch.float32, device=device)


def _block_sizes(num_tokens: int, num_experts: int, device_type: str,
                 block_t: Optional[int]):
    block_e = _next_pow2(num_experts)
    if block_t is None:
        if device_type == "cuda":  # keep a [BLOCK_T, BLOCK_E] fp32 tile around 4k elements
            block_t = max(1, min(64, 4096 // block_e))
        else:  # the interpreter pays ~2 ms per program: few, large programs
            block_t = min(256, _next_pow2(num_tokens))
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"block_t: {block_t} must be a power of 2. Fix: 16, 64, ... or None")
    return block_t, block_e


def _f32_or_zeros(grad: Optional[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if grad is None else grad.float().contiguous()


def _require_same_device(reference: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.device != reference.device:
            raise ValueError(f"{name}: on {tensor.device} but the logits are on "
                             f"{reference.device}. Fix: move it to {reference.device}")


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"shape {tuple(x.shape)}"
    return type(x).__name__


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b
