"""Analytic bytes of one MoE layer's dispatch and combine under three dispatch semantics,
per (source rank, destination rank), from the routing maps of every EP rank:
`link_bytes(maps_PTE, placement, payload, semantics)`.

Legend: P EP ranks, T tokens per rank, E experts, El experts per rank, N nodes, G EP ranks
per node, W row width, K views, n = selected experts of one token on one destination.

Semantics (what one token costs on its way to a destination):
- "row" (Megatron's alltoall dispatcher): one row per (token, selected expert), n rows to a
  rank hosting n of its experts; the combine sends the n expert outputs back.
- "rank" (DeepEP intranode): one copy per (token, destination rank); the destination runs
  its n experts on it and sums their (gated) outputs, so the combine sends one row back.
- "node" (HybridEP / DeepEP internode): hop 1 sends one copy per (token, destination node)
  over the network to the node's proxy (`EpPlacement.proxy`); hop 2 forwards one copy per
  (token, destination rank) inside the node over NVLink; the combine reduces at the rank
  and at the proxy, one row per hop and pair.

Payload kinds (what one (token, destination) pair sends when it hosts n experts):
- "token": one shared row (baseline, Multi-Router, SMoE).
- "multi_view": Multi-View with dedup: n blended rows, or the K views plus n x K mixing
  weights when that is strictly smaller (`views_are_cheaper`). In the node semantic a pair
  that crossed the network as blends can only forward blends; one that crossed as views is
  decided again per rank at the proxy. In the row semantic it is one blended row per
  (token, expert): the baseline's rows.
- "naive_multi_view": the K views per pair (per (token, expert) row under "row") and the
  mixing weights, always (mixed after dispatch).

Payloads on the wire: "tokens" (rows of W elements of `dtype_bytes`), "probs" (one
routing probability per (token, expert) and hop, plus the mixing weights, floats) and
"metadata" (the int64 bookkeeping, `INT_BYTES` each, forward only):
- row: Megatron's alltoall dispatcher all-gathers each rank's E tokens-per-expert counts in
  its preprocess (phase "dispatch_preprocess"; every rank gets E values from every rank).
- rank / node (layers/dedup_dispatcher.py), per hop: 4 split counts to every rank (self
  included), one expert id per (token, expert) selection and an (n, mode) pair per
  (token, destination) pair sent.
The backward sends the gradients of the float tensors in reverse: its matrix is the
transpose; the ints have no gradient. Megatron's allgather dispatcher
(`add_allgather_source`) and the alltoall dispatcher's expert-TP collectives
(`add_expert_tp_collectives`) are modelled on their TP x EP group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

import torch

from megatron_mvmoe.a2a_model.placement import LINKS, EpPlacement
from megatron_mvmoe.config.variants import VARIANTS, get_variant
from megatron_mvmoe.functional.mixing import views_are_cheaper

SEMANTICS = ("row", "rank", "node")
INT_BYTES = 8
"""int64 bookkeeping (split counts, expert ids, (n, mode) pairs)."""
SPLIT_COUNTS = 4
"""Per hop the dedup dispatcher all-to-alls [P, 4] counts: rows, pairs, selections, views."""
PAYLOADS = ("tokens", "probs", "metadata")
KINDS = ("token", "multi_view", "naive_multi_view")
Key = Tuple[str, str, str]
"""(phase: dispatch_preprocess | token_dispatch | token_combine, direction: fwd | bwd,
payload: tokens | probs | metadata)."""


@dataclass(frozen=True)
class PayloadShape:
    """What one dispatched row and its companions cost."""

    width: int
    """W: elements of a dispatched row (D for SMoE, L for the latent variants)."""
    kind: str = "token"
    """One of KINDS."""
    views: int = 1
    """K: views per token (Multi-View)."""
    dtype_bytes: int = 2
    """Bytes per row element (2 for bf16, 4 for fp32)."""
    probs_bytes: int = 4
    """Bytes per routing probability."""
    weight_bytes: int = 4
    """Bytes per mixing weight."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind: unknown {self.kind!r}. Fix: use one of {KINDS}")
        if self.kind != "token" and self.views < 1:
            raise ValueError(f"views: {self.kind} needs views >= 1, got {self.views}")

    @property
    def row_bytes(self) -> int:
        return self.width * self.dtype_bytes


def _pair_cost(n: torch.Tensor, shape: PayloadShape, views_allowed=None):
    """(rows, weights) one (token, destination) pair sends for n experts there (0 if n = 0).

    views_allowed: for node hop 2, where False the pair arrived as blends (rows only)."""
    present = n > 0
    if shape.kind == "token":
        return present.long(), torch.zeros_like(n)
    if shape.kind == "naive_multi_view":
        return present.long() * shape.views, n * shape.views
    views = views_are_cheaper(n, shape.views, shape.width, shape.dtype_bytes,
                              shape.weight_bytes) & present
    if views_allowed is not None:
        views = views & views_allowed
    return torch.where(views, shape.views, n), torch.where(views, n * shape.views, 0)


def _row_cost(n: torch.Tensor, shape: PayloadShape):
    """(rows, weights) of n per-(token, expert) rows (the row semantic)."""
    if shape.kind == "naive_multi_view":
        return n * shape.views, n * shape.views
    return n, torch.zeros_like(n)


class LinkMatrices:
    """Accumulates [P, P] byte matrices (source sends to destination) per forward key."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.m = {k: torch.zeros(ranks, ranks, dtype=torch.long) for k in (
            ("token_dispatch", "tokens"), ("token_dispatch", "probs"),
            ("token_combine", "tokens"))}

    def add(self, phase: str, payload: str, source: int, dests, bytes_):
        matrix = self.m.get((phase, payload))
        if matrix is None:  # not setdefault: that would build a zero matrix on every call
            matrix = self.m[(phase, payload)] = torch.zeros(self.ranks, self.ranks,
                                                           dtype=torch.long)
        matrix[source, dests] += bytes_

    def with_backward(self) -> Dict[Key, torch.Tensor]:
        out = {}
        for (phase, payload), matrix in self.m.items():
            out[(phase, "fwd", payload)] = matrix
            if payload != "metadata":  # ints carry no gradient
                out[(phase, "bwd", payload)] = matrix.T.contiguous()
        return out

    def add_hop_metadata(self, source: int, dests, selections, pairs) -> None:
        """One dedup hop's int64 bookkeeping from `source` to `dests`: expert ids per
        selection and (n, mode) per pair (the split counts: `per_call_bookkeeping`)."""
        self.add("token_dispatch", "metadata", source, dests,
                 (selections + 2 * pairs) * INT_BYTES)


def experts_per_dest(maps_PTE: torch.Tensor, placement: EpPlacement) -> torch.Tensor:
    """n[s, t, q]: experts of token t of rank s hosted on rank q (also [T, E] -> [T, P])."""
    *lead, _ = maps_PTE.shape
    return maps_PTE.reshape(*lead, placement.ep, placement.experts_per_rank).sum(-1)


def link_bytes(maps_PTE: torch.Tensor, placement: EpPlacement, shape: PayloadShape,
               semantics: str) -> Dict[Key, torch.Tensor]:
    """Bytes rank s hands to the collective for rank q: {(phase, direction, payload): [P, P]}.

    maps_PTE: the bool routing map of every EP rank (P, T tokens each, E experts)."""
    if maps_PTE.dim() != 3 or maps_PTE.shape[0] != placement.ep or \
            maps_PTE.shape[2] != placement.num_experts:
        raise ValueError(f"maps_PTE: expected [{placement.ep}, T, {placement.num_experts}], "
                         f"got {tuple(maps_PTE.shape)}. Fix: stack one routing map per EP rank")
    acc = LinkMatrices(placement.ep)
    n_PTQ = experts_per_dest(maps_PTE, placement)
    for source in range(placement.ep):
        add_source_bytes(acc, n_PTQ[source], source, placement, shape, semantics)
    add_per_call_bytes(acc, placement, semantics, calls=1)
    return acc.with_backward()


def add_per_call_bytes(acc: "LinkMatrices", placement: EpPlacement, semantics: str,
                       calls: int) -> None:
    """The bookkeeping every rank sends whatever its tokens, `calls` dispatches, to every rank
    of the group, self included (`per_call_bookkeeping`)."""
    phase = "dispatch_preprocess" if semantics == "row" else "token_dispatch"
    acc.add(phase, "metadata", slice(None), slice(None),
            calls * per_call_bookkeeping(placement, semantics))


def per_call_bookkeeping(placement: EpPlacement, semantics: str, padded: bool = False) -> int:
    """Bytes one rank sends each rank of the group per dispatch whatever its tokens:
    Megatron's all-gather of its E tokens-per-expert counts (row; none when padded to
    capacity: the splits are fixed), the [P, 4] split counts per hop (rank: one hop, node:
    two)."""
    if semantics == "row":
        return 0 if padded else placement.num_experts * INT_BYTES
    return (2 if semantics == "node" else 1) * SPLIT_COUNTS * INT_BYTES


def add_source_bytes(acc: "LinkMatrices", n_TQ: torch.Tensor, source: int,
                     placement: EpPlacement, shape: PayloadShape, semantics: str) -> None:
    """Everything the tokens of EP rank `source` cost (n_TQ: experts of each of its tokens
    on each EP rank), over every hop (the node semantic's NVLink forward is sent by the
    proxy on their behalf); linear in the tokens, so a rank can add its own part alone."""
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics: unknown {semantics!r}. Fix: use one of {SEMANTICS}")
    if semantics == "node":
        _node_hops(n_TQ, source, placement, shape, acc)
        return
    rows, weights = (_row_cost(n_TQ, shape) if semantics == "row"
                     else _pair_cost(n_TQ, shape))
    combine_rows = n_TQ if semantics == "row" else (n_TQ > 0).long()
    dests = torch.arange(placement.ep)
    acc.add("token_dispatch", "tokens", source, dests, rows.sum(0) * shape.row_bytes)
    acc.add("token_dispatch", "probs", source, dests, n_TQ.sum(0) * shape.probs_bytes
            + weights.sum(0) * shape.weight_bytes)
    if semantics == "rank":
        acc.add_hop_metadata(source, dests, n_TQ.sum(0), (n_TQ > 0).sum(0))
    # the combine goes the other way: rank q sends to the source
    acc.m[("token_combine", "tokens")][dests, source] += combine_rows.sum(0) * shape.row_bytes


def _node_hops(n_TQ: torch.Tensor, source: int, placement: EpPlacement, shape: PayloadShape,
               acc: "LinkMatrices") -> None:
    per_node = placement.ranks_per_node
    n_TBG = n_TQ.reshape(n_TQ.shape[0], placement.nodes, per_node)
    for node in range(placement.nodes):
        proxy = placement.proxy(source, node)
        members = torch.arange(node * per_node, (node + 1) * per_node)
        n_TG = n_TBG[:, node]
        n_T = n_TG.sum(-1)
        rows1, weights1 = _pair_cost(n_T, shape)
        acc.add("token_dispatch", "tokens", source, proxy, int(rows1.sum()) * shape.row_bytes)
        acc.add("token_dispatch", "probs", source, proxy, int(n_T.sum()) * shape.probs_bytes
                + int(weights1.sum()) * shape.weight_bytes)
        acc.m[("token_combine", "tokens")][proxy, source] += (
            int((n_T > 0).sum()) * shape.row_bytes)
        acc.add_hop_metadata(source, proxy, int(n_T.sum()), int((n_T > 0).sum()))
        arrived_as_views = (weights1 > 0).unsqueeze(1) if shape.kind == "multi_view" else None
        rows2, weights2 = _pair_cost(n_TG, shape, arrived_as_views)
        acc.add("token_dispatch", "tokens", proxy, members, rows2.sum(0) * shape.row_bytes)
        acc.add("token_dispatch", "probs", proxy, members, n_TG.sum(0) * shape.probs_bytes
                + weights2.sum(0) * shape.weight_bytes)
        acc.m[("token_combine", "tokens")][members, proxy] += (
            (n_TG > 0).sum(0) * shape.row_bytes)
        acc.add_hop_metadata(proxy, members, n_TG.sum(0), (n_TG > 0).sum(0))


def destination_histogram(n_TQ: torch.Tensor, ranks_per_node: int, topk: int) -> torch.Tensor:
    """H[q, a, c]: tokens with a of their experts on rank q and c on q's node (groups of
    `ranks_per_node` ranks): all that `add_source_histogram` needs, built without a host
    sync (scatter_add into a fixed size), so it can run on the device every micro-batch."""
    tokens, ranks = n_TQ.shape
    bins = topk + 1
    n_TB = n_TQ.reshape(tokens, ranks // ranks_per_node, ranks_per_node).sum(-1)
    c_TQ = n_TB.repeat_interleave(ranks_per_node, dim=1)
    index = (torch.arange(ranks, device=n_TQ.device) * bins + n_TQ) * bins + c_TQ
    hist = torch.zeros(ranks * bins * bins, dtype=torch.long, device=n_TQ.device)
    hist.scatter_add_(0, index.flatten(), torch.ones_like(index.flatten()))
    return hist.view(ranks, bins, bins)


def add_source_histogram(acc: LinkMatrices, H_QAC: torch.Tensor, source: int,
                         placement: EpPlacement, shape: PayloadShape, semantics: str) -> None:
    """`add_source_bytes` from `destination_histogram` (built with
    placement.ranks_per_node): every cost is a function of a token's experts on one rank and
    on its node, so weighting the cost of each value by its count gives the same bytes."""
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics: unknown {semantics!r}. Fix: use one of {SEMANTICS}")
    n = torch.arange(H_QAC.shape[1])
    present = (n > 0).long()
    if semantics == "node":
        _node_hops_histogram(acc, H_QAC, n, source, placement, shape)
        return
    W_QA = H_QAC.sum(2)
    rows, weights = _row_cost(n, shape) if semantics == "row" else _pair_cost(n, shape)
    combine = n if semantics == "row" else present
    dests = torch.arange(placement.ep)
    acc.add("token_dispatch", "tokens", source, dests, (W_QA * rows).sum(1) * shape.row_bytes)
    acc.add("token_dispatch", "probs", source, dests, (W_QA * n).sum(1) * shape.probs_bytes
            + (W_QA * weights).sum(1) * shape.weight_bytes)
    if semantics == "rank":
        acc.add_hop_metadata(source, dests, (W_QA * n).sum(1), (W_QA * present).sum(1))
    acc.m[("token_combine", "tokens")][dests, source] += (W_QA * combine).sum(1) * shape.row_bytes


def _node_hops_histogram(acc, H_QAC, n, source, placement, shape) -> None:
    """The node semantic's two hops, every node at once (a few ops per call, not ~20 per
    node: the live metrics run this per layer at every log interval): hop 1 from `source`
    to each node's proxy, by the tokens' expert count on that node (the histogram row of
    the node's first rank); hop 2 from each proxy to its node's members."""
    per_node, present = placement.ranks_per_node, (n > 0).long()
    rows1, weights1 = _pair_cost(n, shape)  # per count c of experts on the node
    arrived_as_views = (weights1 > 0).unsqueeze(0) if shape.kind == "multi_view" else None
    rows2, weights2 = _pair_cost(n.unsqueeze(1).expand(len(n), len(n)), shape, arrived_as_views)
    proxy_N = torch.tensor([placement.proxy(source, node) for node in range(placement.nodes)])
    W_NC = H_QAC[::per_node].sum(1)  # every token once per node, by its count there
    selections_N, pairs_N = (W_NC * n).sum(1), (W_NC * present).sum(1)
    acc.add("token_dispatch", "tokens", source, proxy_N, (W_NC * rows1).sum(1) * shape.row_bytes)
    acc.add("token_dispatch", "probs", source, proxy_N, selections_N * shape.probs_bytes
            + (W_NC * weights1).sum(1) * shape.weight_bytes)
    acc.m[("token_combine", "tokens")][proxy_N, source] += pairs_N * shape.row_bytes
    acc.add_hop_metadata(source, proxy_N, selections_N, pairs_N)
    proxy_Q = proxy_N.repeat_interleave(per_node)  # each member's proxy
    members = torch.arange(len(proxy_Q))
    selections_Q = (H_QAC * n.unsqueeze(1)).sum((1, 2))
    pairs_Q = (H_QAC * present.unsqueeze(1)).sum((1, 2))
    acc.add("token_dispatch", "tokens", proxy_Q, members,
            (H_QAC * rows2).sum((1, 2)) * shape.row_bytes)
    acc.add("token_dispatch", "probs", proxy_Q, members, selections_Q * shape.probs_bytes
            + (H_QAC * weights2).sum((1, 2)) * shape.weight_bytes)
    acc.m[("token_combine", "tokens")][members, proxy_Q] += pairs_Q * shape.row_bytes
    acc.add_hop_metadata(proxy_Q, members, selections_Q, pairs_Q)


def views_pairs(maps_PTE: torch.Tensor, placement: EpPlacement, shape: PayloadShape,
                semantics: str) -> int:
    """(token, destination) pairs that travel as the K views on the first hop (destination
    rank for "rank", node for "node"; none under "row" or without Multi-View)."""
    if shape.kind != "multi_view" or semantics == "row":
        return 0
    n_PTQ = experts_per_dest(maps_PTE, placement)
    if semantics == "node":
        n_PTQ = n_PTQ.reshape(*n_PTQ.shape[:2], placement.nodes, -1).sum(-1)
    _, weights = _pair_cost(n_PTQ, shape)
    return int((weights > 0).sum())


def sent_by_link(matrix_PP: torch.Tensor, placement: EpPlacement) -> Dict[str, torch.Tensor]:
    """Per rank: bytes it sends to itself / inside its node / to other nodes ([P] each)."""
    ranks = torch.arange(placement.ep)
    node = ranks // placement.ranks_per_node
    same_node = node.unsqueeze(1) == node.unsqueeze(0)
    is_self = torch.eye(placement.ep, dtype=torch.bool)
    masks = {"self": is_self, "intra": same_node & ~is_self, "inter": ~same_node}
    return {link: (matrix_PP * masks[link]).sum(1) for link in LINKS}


def received_by_link(matrix_PP: torch.Tensor, placement: EpPlacement) -> Dict[str, torch.Tensor]:
    """Per rank: bytes it receives, by link (the transpose's sends)."""
    return sent_by_link(matrix_PP.T, placement)


def payload_for_variant(variant: str, hidden: int, latent, views: int = 1,
                        dtype_bytes: int = 2, naive: bool = False) -> PayloadShape:
    """The PayloadShape of a model variant (smoe, latent, multi_router, multi_view)."""
    record = get_variant(variant) if variant in VARIANTS else None
    if record is None or record.multi_head or not record.routed_experts:
        raise ValueError(f"variant: no dispatch-semantics model for {variant!r}. Fix: use "
                         "smoe, latent, multi_router or multi_view")
    if not record.latent:
        return PayloadShape(hidden, dtype_bytes=dtype_bytes)
    if not record.multi_view or views == 1:
        return PayloadShape(latent, dtype_bytes=dtype_bytes)
    return PayloadShape(latent, "naive_multi_view" if naive else "multi_view", views,
                        dtype_bytes=dtype_bytes)


def allgather_link_bytes(placement: EpPlacement, tokens: int, shape: PayloadShape,
                         rows_per_token: int = 1) -> Dict[Key, torch.Tensor]:
    """The allgather dispatcher as [P, P] matrices when every rank routes `tokens` tokens
    (`add_allgather_source` for each). `rows_per_token` = k for Multi-View's expanded
    tokens (refused by the layer)."""
    acc = LinkMatrices(placement.ep)
    for source in range(placement.ep):
        add_allgather_source(acc, source, tokens * rows_per_token, shape,
                             placement.num_experts)
    return acc.with_backward()


def add_allgather_source(acc: LinkMatrices, source: int, tokens: int, shape: PayloadShape,
                         num_experts: int) -> None:
    """Megatron's allgather dispatcher, one rank's `tokens` tokens over its TP x EP group
    (`acc.ranks` ranks, self included): the forward all-gathers its rows, its dense [T, E]
    probs and its bool [T, E] routing map (metadata, 1 byte each); the combine
    reduce-scatters the gathered [ranks * T, W] outputs cast to the probs' dtype, T rows
    to each rank. The backward (the transposes) reduce-scatters the rows' and probs'
    gradients and all-gathers the combine's."""
    acc.add("token_dispatch", "tokens", source, slice(None), tokens * shape.row_bytes)
    acc.add("token_dispatch", "probs", source, slice(None),
            tokens * num_experts * shape.probs_bytes)
    acc.add("token_dispatch", "metadata", source, slice(None), tokens * num_experts)
    acc.m[("token_combine", "tokens")][:, source] += tokens * shape.width * shape.probs_bytes


def add_expert_tp_collectives(acc: LinkMatrices, etp_peers_RR: torch.Tensor,
                              shape: PayloadShape) -> None:
    """Megatron's alltoall dispatcher at expert TP > 1, on [R, R] matrices over its TP x EP
    group whose EP all-to-alls `acc` already holds (etp_peers_RR[r, j]: j is in r's expert
    TP group, r itself included): after the all-to-all a rank all-gathers the rows and probs
    it received over its expert TP group (phase dispatch_postprocess); before the combine
    all-to-all it reduce-scatters its expert outputs, cast to the probs' dtype, back to
    the rank that received each row (combine_preprocess). Their backward swaps the two
    (the transposes)."""
    peers = etp_peers_RR.long()
    received_rows = acc.m[("token_dispatch", "tokens")].sum(0)
    received_probs = acc.m[("token_dispatch", "probs")].sum(0)
    acc.m[("dispatch_postprocess", "tokens")] = peers * received_rows.unsqueeze(1)
    acc.m[("dispatch_postprocess", "probs")] = peers * received_probs.unsqueeze(1)
    outputs = received_rows // shape.row_bytes * shape.width * shape.probs_bytes
    acc.m[("combine_preprocess", "tokens")] = (peers * outputs.unsqueeze(1)).T.contiguous()


def payload_and_bookkeeping(matrices: Dict[Key, torch.Tensor],
                            direction: str = "fwd") -> Dict[str, torch.Tensor]:
    """The dispatch side of one direction as {"payload": floats [P, P], "bookkeeping":
    int metadata [P, P]}: every phase before the experts (preprocess and token_dispatch)."""
    zero = torch.zeros_like(next(iter(matrices.values())))
    out = {"payload": zero.clone(), "bookkeeping": zero.clone()}
    for (phase, d, payload), m in matrices.items():
        if d == direction and phase != "token_combine":
            out["bookkeeping" if payload == "metadata" else "payload"] += m
    return out
