"""Bytes on the wire between nodes: what a list of counted collectives puts on each node's
link (per direction), what the interface counters say crossed it, and the difference.

Legend: P ranks, N nodes, a "node link" is a node's one interface to the switch (tx = bytes
leaving the node, rx = bytes arriving).

Design choices:
- Wire model of one collective (gloo, the backend here; checked against the counters):
  all_to_all_single sends each peer its split directly (rank s -> q: peer_bytes[q]);
  all-gather is gloo's ring: the rank at group position i sends (P - 1) inputs to position
  i + 1. Bytes between ranks of one node never reach the node link (they use lo).
- Transport overhead has two parts, both measured, never assumed:
  * TCP/IP + Ethernet headers: every frame on these links is IPv4 TCP with timestamps,
    14 + 20 + 32 = 66 bytes of header per counted packet (GSO super-frames carry one
    header each, and each counts as one packet), so TCP payload = bytes - 66 x packets.
  * gloo's control messages and the window's barriers: a replay of the window's own
    collectives at the smallest sizes gloo still sends (all-to-all with zero splits,
    all-gather of one element), minus that replay's predicted payload.
  measured payload = TCP payload(window) - (TCP payload(replay) - predicted(replay)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

HEADER_BYTES = 14 + 20 + 32
"""Ethernet + IPv4 + TCP with the timestamp option (Linux default) per frame."""
A2A_OPS = ("all_to_all_single",)
GATHER_OPS = ("all_gather_into_tensor", "_all_gather_base", "all_gather")
DIRECTIONS = ("tx", "rx")


@dataclass(frozen=True)
class WireRecord:
    """The part of a counter CollectiveRecord that sets its wire bytes."""

    op: str
    input_bytes: int
    peer_bytes: tuple
    group_ranks: tuple
    payload: str = "tokens"
    direction: str = "fwd"
    layer: str = ""
    phase: str = ""
    dtype: str = "float32"

    @classmethod
    def of(cls, record) -> "WireRecord":
        return cls(record.op, record.input_bytes, tuple(record.peer_bytes),
                   tuple(record.group_ranks), record.payload, record.direction or "",
                   record.layer or "", record.phase or "", record.dtype)


def rank_matrix(records_by_rank: Sequence[Sequence[WireRecord]], world: int) -> torch.Tensor:
    """[P, P] bytes rank s puts on the way to rank q for every rank's records."""
    m_PP = torch.zeros(world, world, dtype=torch.long)
    for source, records in enumerate(records_by_rank):
        for r in records:
            group = list(r.group_ranks) or list(range(world))
            if r.op in A2A_OPS:
                for dest, b in zip(group, r.peer_bytes):
                    m_PP[source, dest] += b
            elif r.op in GATHER_OPS:
                here = group.index(source)
                m_PP[source, group[(here + 1) % len(group)]] += (len(group) - 1) * r.input_bytes
            else:
                raise ValueError(f"op: no wire model for {r.op!r}. Fix: add it to "
                                 "analysis/a2a/wire.py (rank_matrix)")
    return m_PP


def received_split(m_PP: torch.Tensor, node_of_rank: Sequence[int]) -> Dict[str, List[int]]:
    """Bytes each rank receives from the other ranks of its node ("intra") and from other
    nodes ("inter"), its own kept bytes excluded: the receive side that HybridEP and NCCL EP
    divide by the time to report a bandwidth."""
    node = torch.tensor(list(node_of_rank))
    same = node.unsqueeze(1) == node.unsqueeze(0)
    other = ~torch.eye(len(node), dtype=torch.bool)
    return {"intra": (m_PP * (same & other)).sum(0).tolist(),
            "inter": (m_PP * ~same).sum(0).tolist()}


def node_link_bytes(m_PP: torch.Tensor, node_of_rank: Sequence[int]) -> Dict[int, Dict[str, int]]:
    """{node: {tx, rx}} inter-node bytes on each node's link for a [P, P] matrix."""
    node = torch.tensor(list(node_of_rank))
    cross = node.unsqueeze(1) != node.unsqueeze(0)
    m = m_PP * cross
    return {int(n): {"tx": int(m[node == n].sum()), "rx": int(m[:, node == n].sum())}
            for n in sorted(set(node_of_rank))}


def tcp_payload(delta: Dict[str, int], header_bytes: int = HEADER_BYTES) -> Dict[str, int]:
    """TCP payload bytes per direction of one interface's counter delta."""
    return {d: delta[f"{d}_bytes"] - header_bytes * delta[f"{d}_packets"] for d in DIRECTIONS}


def counter_delta(before: Dict[str, int], after: Dict[str, int]) -> Dict[str, int]:
    return {k: after[k] - before[k] for k in before}


def measured_payload(window: Dict[str, int], replay: Dict[str, int],
                     replay_predicted: Dict[str, int],
                     header_bytes: int = HEADER_BYTES) -> Dict[str, Dict[str, int]]:
    """Payload and the two overheads per direction of one node link (counter deltas of the
    window and of its minimal-size replay); header_bytes per frame (66 on Ethernet; an
    IPoIB link has a 4-byte encapsulation instead of Ethernet's 14: 56)."""
    out = {}
    w, r = tcp_payload(window, header_bytes), tcp_payload(replay, header_bytes)
    for d in DIRECTIONS:
        control = r[d] - replay_predicted[d]
        out[d] = {"bytes": window[f"{d}_bytes"], "packets": window[f"{d}_packets"],
                  "headers": header_bytes * window[f"{d}_packets"], "control": control,
                  "payload": w[d] - control}
    return out


def relative_error(measured: float, predicted: float) -> float:
    if predicted == 0:
        return 0.0 if measured == 0 else float("inf")
    return (measured - predicted) / predicted


def minimal_replay_sizes(records: Sequence[WireRecord]) -> List[WireRecord]:
    """The smallest collective gloo still performs in full for each record: zero splits
    for all-to-all (gloo still sends its control messages), one element for all-gather
    (gloo skips an empty one entirely)."""
    out = []
    for r in records:
        if r.op in A2A_OPS:
            out.append(WireRecord(r.op, 0, tuple(0 for _ in r.peer_bytes), r.group_ranks,
                                  r.payload, r.direction, r.layer, r.phase, r.dtype))
        else:
            one = torch.empty(0, dtype=getattr(torch, r.dtype)).element_size()
            out.append(WireRecord(r.op, one, (), r.group_ranks, r.payload, r.direction,
                                  r.layer, r.phase, r.dtype))
    return out
