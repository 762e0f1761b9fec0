"""Measured vs analytic MoE communication per layer: merge the per-rank counts of
`a2a_counter` with `a2a_analytic` into rows and exact-equality checks.

Design choices:
- Only what is deterministic per rank is compared rank by rank: with the alltoall dispatcher
  a rank always SENDS T*k rows in the forward dispatch and in the backward of the combine;
  what it receives (the forward combine's and backward dispatch's inputs) depends on the
  routing, so those are compared as sums over the EP group (= EP * T * k rows).
- The allgather dispatcher: the forward dispatch all-gathers T rows per rank plus the dense
  [T, E] fp32 probs (both float, so the counter files both under payload "tokens"; they are
  compared as one sum) and the combine reduce-scatters the gathered [EP*T, W] tensor.
- A check is `counted == analytic` as integers, never a tolerance.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch

from megatron_mvmoe.analysis.a2a.analytic import CommShape, dispatch_bytes, group_total_bytes

Key = Tuple[str, str, str, str]
"""(phase, direction, payload, op)."""


def rank_counts(records) -> Dict[str, Dict[Key, int]]:
    """layer -> {(phase, direction, payload, op): input bytes} for one rank's records."""
    out: Dict[str, Dict[Key, int]] = defaultdict(lambda: defaultdict(int))
    for r in records:
        if r.layer is None:
            continue
        out[r.layer][(r.phase, r.direction, r.payload, r.op)] += r.input_bytes
    return {layer: dict(keys) for layer, keys in out.items()}


@dataclass
class Check:
    layer: str
    what: str
    counted: int
    analytic: int

    @property
    def ok(self) -> bool:
        return self.counted == self.analytic

    def as_dict(self) -> dict:
        return {"layer": self.layer, "what": self.what, "counted": self.counted,
                "analytic": self.analytic, "ok": self.ok}


def _get(counts: Dict[Key, int], phase: str, direction: str, payload: str, ops: Sequence[str]):
    return sum(b for (p, d, pl, op), b in counts.items()
               if p == phase and d == direction and pl == payload and op in ops)


_A2A = ("all_to_all_single",)
_GATHER = ("all_gather_into_tensor", "_all_gather_base", "all_gather")
_SCATTER = ("reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter")


def checks(variant: str, dispatcher: str, shape: CommShape,
           per_rank: Sequence[Dict[str, Dict[Key, int]]]) -> List[Check]:
    """Exact counted-vs-analytic checks for every MoE layer (per rank and group sums)."""
    volume = dispatch_bytes(variant, dispatcher, shape)
    layers = sorted({layer for counts in per_rank for layer in counts})
    out: List[Check] = []
    for layer in layers:
        ranks = [counts.get(layer, {}) for counts in per_rank]
        if dispatcher == "alltoall":
            out += _alltoall_checks(layer, ranks, volume, group_total_bytes(
                variant, dispatcher, shape))
        else:
            out += _allgather_checks(layer, ranks, volume)
    return out


def _alltoall_checks(layer, ranks, volume, group_total) -> List[Check]:
    out = []
    for rank, counts in enumerate(ranks):
        out.append(Check(layer, f"rank{rank} dispatch fwd tokens",
                         _get(counts, "token_dispatch", "fwd", "tokens", _A2A), volume.tokens_in))
        out.append(Check(layer, f"rank{rank} combine bwd tokens",
                         _get(counts, "token_combine", "bwd", "tokens", _A2A), volume.tokens_in))
        out.append(Check(layer, f"rank{rank} dispatch fwd probs",
                         _get(counts, "token_dispatch", "fwd", "probs", _A2A), volume.probs_in))
        out.append(Check(layer, f"rank{rank} dispatch fwd metadata (all-gather in)",
                         sum(b for (p, d, pl, op), b in counts.items() if d == "fwd"
                             and pl == "metadata" and op in _GATHER), volume.metadata_in))
    for phase, direction in (("token_combine", "fwd"), ("token_dispatch", "bwd")):
        summed = sum(_get(c, phase, direction, "tokens", _A2A) for c in ranks)
        out.append(Check(layer, f"group {phase.split('_')[1]} {direction} tokens", summed,
                         group_total))
    return out


def _allgather_checks(layer, ranks, volume) -> List[Check]:
    out = []
    for rank, counts in enumerate(ranks):
        # the counter labels every float payload "tokens": the gathered [T, E] probs too
        out.append(Check(layer, f"rank{rank} dispatch fwd tokens+probs (all-gather in)",
                         _get(counts, "token_dispatch", "fwd", "tokens", _GATHER)
                         + _get(counts, "token_dispatch", "fwd", "probs", _GATHER),
                         volume.tokens_in + volume.probs_in))
        out.append(Check(layer, f"rank{rank} dispatch fwd routing map (all-gather in)",
                         _get(counts, "token_dispatch", "fwd", "metadata", _GATHER),
                         volume.metadata_in))
        out.append(Check(layer, f"rank{rank} combine fwd tokens (reduce-scatter in)",
                         _get(counts, "token_combine", "fwd", "tokens", _SCATTER),
                         volume.tokens_out))
    return out


def per_layer_rows(per_rank: Sequence[Dict[str, Dict[Key, int]]]) -> List[dict]:
    """Mean bytes per rank for every (layer, phase, direction, payload, op) seen."""
    sums: Dict[Tuple, int] = defaultdict(int)
    for counts in per_rank:
        for layer, keys in counts.items():
            for key, value in keys.items():
                sums[(layer, *key)] += value
    ranks = max(len(per_rank), 1)
    return [{"layer": k[0], "phase": k[1], "direction": k[2], "payload": k[3], "op": k[4],
             "bytes_per_rank": v / ranks} for k, v in sorted(sums.items(), key=str)]


# ---- dispatch semantics: counted bytes per destination link vs the analytic matrices ----
PeerKey = Tuple[str, str, str]
"""(phase, direction, payload) of the all-to-all token and float payloads."""


def peer_counts(records) -> Dict[str, Dict[PeerKey, List[int]]]:
    """layer -> {(phase, direction, payload): bytes this rank sent to each group rank}, for
    every all-to-all and all-gather of the dispatchers (an all-gather hands its input to
    every group rank, itself included); the payload includes the int "metadata"."""
    out: Dict[str, Dict[PeerKey, List[int]]] = defaultdict(dict)
    for r in records:
        if r.layer is None or r.op not in _A2A + _GATHER:
            continue
        peers = r.peer_bytes if r.op in _A2A else (r.input_bytes,) * r.group_size
        key = (_phase_kind(r.phase), r.direction, r.payload)
        current = out[r.layer].setdefault(key, [0] * len(peers))
        out[r.layer][key] = [a + b for a, b in zip(current, peers)]
    return dict(out)


def sent_to_ranks(records) -> Dict[str, Dict[PeerKey, Dict[int, int]]]:
    """layer -> {(phase, direction, payload): {global rank: bytes this rank handed to the
    collective for it}} over every collective of the dispatchers (all-to-alls, all-gathers
    and reduce-scatters, whatever their group: EP, expert TP or both), so groups of
    different ranks add up per destination."""
    out: Dict[str, Dict[PeerKey, Dict[int, int]]] = defaultdict(dict)
    for r in records:
        if r.layer is None:
            continue
        per_rank = out[r.layer].setdefault((_phase_kind(r.phase), r.direction, r.payload), {})
        for rank, sent in zip(r.group_ranks, r.peer_bytes):
            per_rank[rank] = per_rank.get(rank, 0) + sent
    return dict(out)


def _phase_kind(phase: str) -> str:
    """The per-row dispatcher's `dispatch_preprocess_rows` / `_permuted` entry points run
    Megatron's preprocess too: one phase for the analytic model."""
    return "dispatch_preprocess" if phase.startswith("dispatch_preprocess") else phase


def semantic_checks(matrices, placement, per_rank: Sequence[Dict[PeerKey, List[int]]],
                    layer: str = "") -> List[Check]:
    """counted == analytic, per rank, (phase, direction, payload) and link (self / intra /
    inter); `matrices` from dispatch_semantics.link_bytes, `per_rank` one layer's
    peer_counts of every EP rank (EP rank = position in the group)."""
    from megatron_mvmoe.a2a_model.semantics import sent_by_link

    out: List[Check] = []
    for key in sorted(matrices):
        analytic = sent_by_link(matrices[key], placement)
        for rank, counts in enumerate(per_rank):
            counted_row = torch.tensor(counts.get(key, [0] * placement.ep)).unsqueeze(0)
            padded = torch.zeros(placement.ep, placement.ep, dtype=torch.long)
            padded[rank] = counted_row
            counted = sent_by_link(padded, placement)
            for link in ("self", "intra", "inter"):
                out.append(Check(layer, f"rank{rank} {' '.join(key)} {link}",
                                 int(counted[link][rank]), int(analytic[link][rank])))
    return out
