"""Analytic MoE communication bytes per layer, per rank, per direction: `dispatch_bytes`.

Stable API (tools/a2a_volume.py builds on it):

    a2a = CommShape(tokens=T_local, hidden=D, topk=k, latent=L, heads=H, dtype_bytes=2,
                    ep=EP, tp=TP, etp=ETP)
    dispatch_bytes(variant, "alltoall", a2a) -> CommVolume(tokens_in, tokens_out, probs_in,
                                                              rows, row_width, note)

`tokens_in` is what one rank hands to the collective in ONE direction of the dispatch (the
combine sends the same amount back; backward repeats both with gradients). For the
alltoall dispatcher it is deterministic per rank: T * k rows (including the rows that stay
on this rank), so it equals the counted `input_bytes` of the forward dispatch all-to-all;
what each rank receives depends on the routing, and sums over the EP group to the same total.

Rows and widths per variant (T tokens on this rank, k top-k, D hidden, L latent, H heads):
- smoe:          T*k rows of D
- latent, multi_router, multi_view: T*k rows of L  (Multi-View mixes before dispatch: one
                 row per (token, selected expert), exactly the baseline's count)
- mh_moe:        T*H*k rows of D/H = T*k*D elements (sub-tokens routed on their own)
Allgather dispatcher (unique tokens gathered over TP x EP, reduce-scatter back): each rank
sends T rows of width W (D, L or D/H with T*H rows); Multi-View there would need its
"expanded tokens" (T*k pseudo-tokens), k times more, so the layer refuses it: the figure
is reported (note="refused") to state that cost.
Probs travel with the tokens in the alltoall dispatcher: one fp32 value per row.
Per-destination figures (which rank sends what to whom, split intra / inter-node) and the
deduplicating semantics (per destination rank / node) are in analysis.dispatch_semantics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

VARIANTS = ("smoe", "latent", "multi_router", "multi_view", "mh_moe")
DISPATCHERS = ("alltoall", "allgather")


@dataclass(frozen=True)
class CommShape:
    """What sets the communication volume of one MoE layer on one rank."""

    tokens: int
    """T: tokens this rank routes (sequence-parallel slice x micro-batch)."""
    hidden: int
    """D: model hidden size."""
    topk: int
    """k: experts per token (per sub-token for MH-MoE)."""
    latent: Optional[int] = None
    """L: latent size (latent, multi_router, multi_view)."""
    heads: int = 1
    """H: MH-MoE sub-tokens per token."""
    dtype_bytes: int = 4
    """Bytes per element of the dispatched rows (2 for bf16, 4 for fp32)."""
    probs_bytes: int = 4
    """Bytes per routing probability (fp32 router dtype)."""
    ep: int = 1
    """Expert-parallel size (the all-to-all group)."""
    tp: int = 1
    """Tensor-parallel size (the allgather dispatcher gathers over TP x EP)."""
    experts: int = 0
    """E: the allgather dispatcher also gathers the dense [T, E] probs (0: not counted)."""


@dataclass(frozen=True)
class CommVolume:
    tokens_in: int
    """Bytes of token rows one rank hands to the dispatch collective (one direction)."""
    tokens_out: Optional[int]
    """Bytes one rank gets back from it; None when it depends on the routing (alltoall)."""
    probs_in: int
    """Bytes of routing probabilities sent alongside (alltoall) or gathered (allgather)."""
    rows: int
    """Rows one rank sends."""
    row_width: int
    """Elements per row."""
    note: str = ""


def row_shape(variant: str, shape: CommShape):
    """(rows per token and slot multiplier, row width) of the dispatched rows."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: unknown {variant!r}. Fix: use one of {VARIANTS}")
    if variant == "smoe":
        return shape.tokens, shape.hidden
    if variant == "mh_moe":
        if shape.hidden % shape.heads:
            raise ValueError(f"heads: {shape.heads} does not divide hidden {shape.hidden}")
        return shape.tokens * shape.heads, shape.hidden // shape.heads
    if not shape.latent or shape.latent <= 0:
        raise ValueError(f"latent: variant {variant} needs a positive latent size")
    return shape.tokens, shape.latent


def dispatch_bytes(variant: str, dispatcher: str, shape: CommShape) -> CommVolume:
    """Bytes of one dispatch (= one combine) of one MoE layer on one rank."""
    units, width = row_shape(variant, shape)
    if dispatcher == "alltoall":
        rows = units * shape.topk
        return CommVolume(rows * width * shape.dtype_bytes, None,
                          rows * shape.probs_bytes, rows, width)
    if dispatcher == "allgather":
        group = shape.tp * shape.ep
        rows = units * shape.topk if variant == "multi_view" else units
        note = ("refused: per-(token, expert) rows would be gathered as expanded tokens, "
                f"{shape.topk}x the baseline") if variant == "multi_view" else ""
        token_bytes = rows * width * shape.dtype_bytes
        probs = rows * shape.experts * shape.probs_bytes
        return CommVolume(token_bytes, token_bytes * group, probs, rows, width, note)
    raise ValueError(f"dispatcher: unknown {dispatcher!r}. Fix: use one of {DISPATCHERS}")


def group_total_bytes(variant: str, dispatcher: str, shape: CommShape) -> int:
    """Token bytes handed to one dispatch collective summed over the EP (x TP) group, when
    every rank routes `shape.tokens` tokens: for the alltoall dispatcher also the combine's
    and both backward passes' totals."""
    group = shape.ep if dispatcher == "alltoall" else shape.ep * shape.tp
    return dispatch_bytes(variant, dispatcher, shape).tokens_in * group


def layer_bytes_per_step(variant: str, dispatcher: str, shape: CommShape) -> dict:
    """Token bytes one rank hands over per layer: dispatch and combine, fwd and bwd
    (None where the per-rank figure depends on the routing; see group_total_bytes)."""
    volume = dispatch_bytes(variant, dispatcher, shape)
    one = volume.tokens_in
    if dispatcher == "allgather":  # combine is a reduce-scatter of the gathered tensor
        back = volume.tokens_out
        return {"dispatch_fwd": one, "combine_fwd": back, "dispatch_bwd": back,
                "combine_bwd": one}
    return {"dispatch_fwd": one, "combine_fwd": None, "dispatch_bwd": None,
            "combine_bwd": one}
