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
Bookkeeping (`metadata_in`): the alltoall dispatcher all-gathers E int64 tokens-per-expert
counts per rank (not when padded to capacity), the allgather dispatcher the bool [T, E]
routing map; the dedup dispatchers' per-destination bookkeeping is in
a2a_model.semantics.
Expert capacity (`capacity_factor`, Megatron's moe_expert_capacity_factor; C =
ceil(units*k / E * factor), Megatron's get_capacity, per rank): padded to capacity
(`pad_to_capacity`), every rank sends exactly C*E rows (padding rows included) and receives
C*E, whatever the routing; dropping without padding sends the rows left in the routing map,
`kept_rows` when given (exact), else the bound min(units*k, C*E) (note="at most"). The
allgather dispatcher gathers the tokens before its local permute, so capacity does not
change its bytes.
Node-limited routing (`nodes`, `group_topk`: Megatron's moe_router_num_groups = nodes,
moe_router_group_topk): the alltoall rows do not change (T*k), but each token's k experts lie
in at most group_topk nodes: `node_copies_per_token` gives the range of distinct
destination nodes per token (one copy each in the "node" dedup semantic of
a2a_model.semantics), exact when its two ends meet; `node_hop_rows` the rows a
rank sends over that network hop.
Per-destination figures (which rank sends what to whom, split intra / inter-node) and the
deduplicating semantics (per destination rank / node) are in a2a_model.semantics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from megatron_mvmoe.config.variants import ROUTED_VARIANT_NAMES, get_variant
from megatron_mvmoe.functional.mixing import views_are_cheaper

VARIANTS = ROUTED_VARIANT_NAMES
INT64_BYTES = 8
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
    """E: the allgather dispatcher also gathers the dense [T, E] probs (0: not counted);
    the expert capacity needs it."""
    capacity_factor: Optional[float] = None
    """Megatron's moe_expert_capacity_factor (None: dropless)."""
    pad_to_capacity: bool = False
    """Megatron's moe_pad_expert_input_to_capacity: every expert gets exactly C rows."""
    kept_rows: Optional[int] = None
    """Rows the capacity left in this rank's routing map (dropping without padding); None
    gives the upper bound."""
    nodes: int = 1
    """Nodes the EP group spans (node-limited routing: moe_router_num_groups = nodes)."""
    group_topk: Optional[int] = None
    """Megatron's moe_router_group_topk: groups (nodes) a token may use (None: all)."""


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
    metadata_in: int = 0
    """Bytes of int bookkeeping one rank hands to the dispatch's all-gather: Megatron's
    alltoall dispatcher its E int64 tokens-per-expert counts (none when padded to
    capacity: the splits are fixed), the allgather dispatcher its bool [T, E] routing map."""


def row_shape(variant: str, shape: CommShape):
    """(rows per token and slot multiplier, row width) of the dispatched rows: the variant
    record's routed rows and row width (config/variants.py)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: unknown {variant!r}. Fix: use one of {VARIANTS}")
    record = get_variant(variant)
    width = record.expert_input(shape.hidden, shape.latent, shape.heads)
    return shape.tokens * record.routed_rows(shape.heads), width


def expert_capacity(units: int, shape: CommShape) -> int:
    """C rows per expert: Megatron's get_capacity(units * k, E, factor)."""
    if shape.experts <= 0:
        raise ValueError("experts: the expert capacity needs the expert count E. "
                         "Fix: set CommShape.experts")
    return math.ceil(units * shape.topk / shape.experts * shape.capacity_factor)


def alltoall_rows(units: int, shape: CommShape) -> Tuple[int, Optional[int], str]:
    """(rows sent, rows received or None when routing-dependent, note) of the alltoall
    dispatcher, dropless or with the expert capacity (see the module docstring)."""
    dropless = units * shape.topk
    if shape.capacity_factor is None:
        return dropless, None, ""
    capacity_rows = expert_capacity(units, shape) * shape.experts
    if shape.pad_to_capacity:
        return capacity_rows, capacity_rows, ""
    if shape.kept_rows is not None:
        return shape.kept_rows, None, ""
    return min(dropless, capacity_rows), None, "at most: dropped rows depend on the routing"


def node_copies_per_token(shape: CommShape) -> Tuple[int, int]:
    """(fewest, most) distinct destination nodes of one token's k experts under node-limited
    routing (E / nodes experts per node): at least ceil(k / per_node), at most
    min(k, group_topk, nodes)."""
    if shape.experts <= 0 or shape.experts % shape.nodes:
        raise ValueError(f"nodes: {shape.nodes} must divide experts {shape.experts}. Fix: "
                         "set CommShape.experts and a node count that divides it")
    per_node = shape.experts // shape.nodes
    most = min(shape.topk, shape.nodes, shape.group_topk or shape.nodes)
    fewest = math.ceil(shape.topk / per_node)
    if fewest > most:
        raise ValueError(f"group_topk: {shape.group_topk} nodes of {per_node} experts cannot "
                         f"hold top-{shape.topk}. Fix: raise group_topk or lower topk")
    return fewest, most


def node_hop_rows(shape: CommShape, views: int = 1,
                  weight_bytes: int = 4) -> Tuple[int, int]:
    """(fewest, most) rows one rank sends over the network hop of the "node" dedup semantic
    (a2a_model.semantics: one copy per (token, destination node)) under node-limited
    routing, of width W = latent (or hidden) and `shape.dtype_bytes`.

    One shared row per (token, node) (views = 1): T * node_copies_per_token. Multi-View
    (views = K > 1) sends per (token, node) with n experts there n blends, or the K views
    when cheaper (`views_are_cheaper`, so then K < n): between 1 and n rows per pair, at most
    k per token; with one node per token (n = k) it is exact."""
    fewest, most = node_copies_per_token(shape)
    if views == 1:
        return shape.tokens * fewest, shape.tokens * most
    if most > 1:
        return shape.tokens * fewest, shape.tokens * shape.topk
    width = shape.latent or shape.hidden
    cheaper = views_are_cheaper(shape.topk, views, width, shape.dtype_bytes, weight_bytes)
    rows = shape.tokens * (views if cheaper else shape.topk)
    return rows, rows


def dispatch_bytes(variant: str, dispatcher: str, shape: CommShape) -> CommVolume:
    """Bytes of one dispatch (= one combine) of one MoE layer on one rank."""
    units, width = row_shape(variant, shape)
    if dispatcher == "alltoall":
        rows, received, note = alltoall_rows(units, shape)
        out = None if received is None else received * width * shape.dtype_bytes
        counts = 0 if shape.capacity_factor is not None and shape.pad_to_capacity else (
            shape.experts * INT64_BYTES)
        return CommVolume(rows * width * shape.dtype_bytes, out,
                          rows * shape.probs_bytes, rows, width, note, counts)
    if dispatcher == "allgather":
        group = shape.tp * shape.ep
        per_row = get_variant(variant).multi_view  # per-(token, expert) rows
        rows = units * shape.topk if per_row else units
        note = ("refused: per-(token, expert) rows would be gathered as expanded tokens, "
                f"{shape.topk}x the baseline") if per_row else ""
        token_bytes = rows * width * shape.dtype_bytes
        probs = rows * shape.experts * shape.probs_bytes
        return CommVolume(token_bytes, token_bytes * group, probs, rows, width, note,
                          rows * shape.experts)
    raise ValueError(f"dispatcher: unknown {dispatcher!r}. Fix: use one of {DISPATCHERS}")


def group_total_bytes(variant: str, dispatcher: str, shape: CommShape) -> int:
    """Token bytes handed to one dispatch collective summed over the EP (x TP) group, when
    every rank routes `shape.tokens` tokens (and, dropping without padding, keeps
    `kept_rows`): for the alltoall dispatcher also the combine's and both backward passes'
    totals."""
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
    back = volume.tokens_out  # known when padded to capacity, else routing-dependent
    return {"dispatch_fwd": one, "combine_fwd": back, "dispatch_bwd": back,
            "combine_bwd": one}
