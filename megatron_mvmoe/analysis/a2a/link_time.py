"""All-to-all time against the link limits, and its share of step time; and the one-link-
per-node model (`WireLink`) that tools/a2a_wire.py checks on links of set rate.

Design choices (stated, so every figure can be redone by hand):
- One direction of one collective on one rank takes intra / B_nvlink + inter / B_network,
  where intra (inter) is the larger of what the rank sends and receives inside its node
  (to other nodes): links are full duplex, so the busier side of each link bounds it. The
  collective ends when its slowest rank does: the max over ranks (the straggler).
- Self bytes use no link. Intra-node and network transfers are not overlapped with each
  other nor with compute (an upper bound on exposed time; DeepEP/HybridEP overlap some).
- Defaults: NVLink4 (H100/H200) 450 GB/s per direction on the datasheet, about 370 GB/s
  achieved by NCCL all-to-all; NDR InfiniBand 400 Gb/s = 50 GB/s per port, about 48 GB/s
  achieved; one NIC per GPU (rail-optimised), so every rank has its own network link.
- Compute time = analytic training FLOPs / achieved FLOP/s (stated per run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

from megatron_mvmoe.a2a_model.semantics import Key, received_by_link, sent_by_link
from megatron_mvmoe.a2a_model.placement import EpPlacement

GB = 1e9


@dataclass(frozen=True)
class LinkSpec:
    """Achieved bandwidths per GPU and direction."""

    nvlink_GBps: float = 370.0
    """Intra-node (NVLink4: 450 GB/s per direction datasheet, ~370 achieved by NCCL)."""
    network_GBps: float = 48.0
    """Inter-node per GPU (NDR InfiniBand 400 Gb/s = 50 GB/s, ~48 achieved)."""

    def __post_init__(self) -> None:
        if self.nvlink_GBps <= 0 or self.network_GBps <= 0:
            raise ValueError("nvlink_GBps / network_GBps: must be > 0. Fix: pass the "
                             "achieved bandwidths in GB/s")


def rank_times_s(matrix_PP: torch.Tensor, placement: EpPlacement,
                 links: LinkSpec) -> torch.Tensor:
    """Seconds each rank spends on one direction of one collective ([P])."""
    sent, received = sent_by_link(matrix_PP, placement), received_by_link(matrix_PP, placement)
    intra = torch.maximum(sent["intra"], received["intra"]).double()
    inter = torch.maximum(sent["inter"], received["inter"]).double()
    return intra / (links.nvlink_GBps * GB) + inter / (links.network_GBps * GB)


def layer_a2a_time_s(matrices: Dict[Key, torch.Tensor], placement: EpPlacement,
                     links: LinkSpec) -> Dict[str, float]:
    """Per (phase, direction) of one layer: max-rank seconds for all payloads together
    (bookkeeping included), and "total" (dispatch + combine, forward + backward; Megatron's
    tokens-per-expert all-gather as "dispatch_preprocess")."""
    out: Dict[str, float] = {}
    for phase in ("dispatch_preprocess", "token_dispatch", "token_combine"):
        for direction in ("fwd", "bwd"):
            parts = [m for (p, d, _), m in matrices.items() if p == phase and d == direction]
            out[f"{phase}/{direction}"] = float(rank_times_s(
                sum(parts), placement, links).max()) if parts else 0.0
    out["total"] = sum(out.values())
    return out


def compute_time_s(flops: float, achieved_tflops: float) -> float:
    if achieved_tflops <= 0:
        raise ValueError("achieved_tflops: must be > 0. Fix: pass the achieved TFLOP/s")
    return flops / (achieved_tflops * 1e12)


def a2a_share(a2a_s: float, compute_s: float) -> float:
    """Fraction of step time in the all-to-all (no overlap)."""
    total = a2a_s + compute_s
    return a2a_s / total if total > 0 else 0.0


# ---- one link per node, of known rate: the model checked on shaped links (tools/a2a_wire.py)
@dataclass(frozen=True)
class WireLink:
    """A node's one network link: rate, protocol efficiency, latency, per-message cost.

    time of one collective = max over nodes and directions of bytes / (efficiency x rate)
    + latency_s + per_message_s x messages (the busiest rank's sends); collectives of one
    layer and direction run one after another, so their times add."""

    rate_bps: float
    """Link rate in bit/s (the tc tbf rate, or the NIC's)."""
    efficiency: float = 1.0
    """Payload share of the rate actually achieved (headers, protocol, stack)."""
    latency_s: float = 0.0
    """One-way link latency per collective (0 here: netem is absent, see a2a_wire.md)."""
    per_message_s: float = 0.0
    """Fixed software cost per message sent (gloo/NCCL call, syscall, wake-up)."""

    def __post_init__(self) -> None:
        if self.rate_bps <= 0 or self.efficiency <= 0:
            raise ValueError("rate_bps / efficiency: both must be > 0. Fix: pass the link "
                             "rate in bit/s and a fitted efficiency")


def collective_wire_time_s(node_bytes: Dict[int, Dict[str, int]], messages: int,
                           link: WireLink) -> float:
    """Seconds of one collective: {node: {tx, rx}} inter-node bytes and the busiest rank's
    message count."""
    busiest = max((max(v["tx"], v["rx"]) for v in node_bytes.values()), default=0)
    return (busiest * 8 / (link.efficiency * link.rate_bps) + link.latency_s
            + link.per_message_s * messages)


def fit_wire_link(samples, rate_key: str = "rate_bps"):
    """Least-squares efficiency and per-message cost from timed samples: each sample is
    {rate_bps, seconds, collectives: [(busiest_bytes, messages), ...]};
    seconds = sum(bytes * 8 / rate) / efficiency + per_message_s * sum(messages).
    Rows are divided by the measured seconds, so the fit minimises relative errors (a slow
    setting does not outweigh a fast one)."""
    rows = [[sum(b for b, _ in s["collectives"]) * 8 / s[rate_key] / s["seconds"],
             float(sum(m for _, m in s["collectives"])) / s["seconds"]] for s in samples]
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.ones(len(samples), 1, dtype=torch.float64)
    inv_eff, per_message = torch.linalg.lstsq(a, y).solution.flatten().tolist()
    if inv_eff <= 0:
        raise ValueError("samples: the fit gives a non-positive byte term. Fix: time larger "
                         "payloads or slower rates, where bytes dominate")
    return 1.0 / inv_eff, max(per_message, 0.0)
