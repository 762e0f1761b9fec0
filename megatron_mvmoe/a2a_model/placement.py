"""Where EP ranks and experts sit on nodes: `EpPlacement`.

Legend: P expert-parallel ranks, G EP ranks per node, N = P / G nodes, E experts,
El = E / P experts per rank.

Design choices:
- Experts sit on EP ranks in Megatron's contiguous layout (rank p holds experts
  [p*El, (p+1)*El)); EP ranks fill nodes in order (rank p on node p // G). Megatron-Core
  builds the expert grid in the order tp-cp-ep-dp-pp with the EXPERT tensor-parallel size,
  so an EP group is strided by ETP only (not by the attention TP): a node of
  `gpus_per_node` GPUs holds gpus_per_node // ETP ranks of one EP group (`for_layout`).
- Links are classified per (source rank, destination rank): "self" (the rank keeps it, no
  link), "intra" (same node: NVLink) or "inter" (another node: the network).
- The node semantic's proxy (HybridEP / DeepEP internode, rail-aligned): a token bound for
  node b crosses the network once, to the rank of node b with the sender's local index,
  which forwards it over NVLink; for the sender's own node the proxy is the sender itself.
"""

from __future__ import annotations

from dataclasses import dataclass

LINKS = ("self", "intra", "inter")


@dataclass(frozen=True)
class EpPlacement:
    """An EP group of `ep` ranks, `ranks_per_node` of them per node, `num_experts` experts."""

    ep: int
    ranks_per_node: int
    num_experts: int

    def __post_init__(self) -> None:
        if self.ep < 1 or self.ranks_per_node < 1:
            raise ValueError(f"ep / ranks_per_node: must be >= 1, got {self.ep} / "
                             f"{self.ranks_per_node}. Fix: pass positive sizes")
        if self.ep % self.ranks_per_node:
            raise ValueError(f"ranks_per_node: {self.ranks_per_node} does not divide ep "
                             f"{self.ep}. Fix: pick --gpus-per-node so nodes hold whole "
                             "groups of EP ranks")
        if self.num_experts % self.ep:
            raise ValueError(f"ep: {self.ep} does not divide the {self.num_experts} experts. "
                             "Fix: pick an EP size that divides num_moe_experts")

    @classmethod
    def for_layout(cls, ep: int, etp: int, gpus_per_node: int, num_experts: int):
        """Placement of one EP group in Megatron's expert rank order (etp fastest, then ep)."""
        if gpus_per_node % etp:
            raise ValueError(f"gpus_per_node: {gpus_per_node} is not a multiple of etp {etp}. "
                             "Fix: keep expert TP inside a node")
        return cls(ep, min(ep, max(1, gpus_per_node // etp)), num_experts)

    @property
    def nodes(self) -> int:
        return self.ep // self.ranks_per_node

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def rank_of_expert(self, expert: int) -> int:
        return expert // self.experts_per_rank

    def proxy(self, source: int, node: int) -> int:
        """The rank of `node` that receives `source`'s tokens over the network."""
        return node * self.ranks_per_node + source % self.ranks_per_node

    def link(self, source: int, dest: int) -> str:
        if source == dest:
            return "self"
        return "intra" if self.node_of(source) == self.node_of(dest) else "inter"
