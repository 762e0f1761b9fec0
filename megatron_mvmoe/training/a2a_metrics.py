"""Live all-to-all metrics: per MoE layer and log interval, the bytes each EP rank sends and
receives in the dispatch and combine, forward and backward, from the routing maps the run
already has (`A2AMonitor`).

Legend: P EP ranks, T tokens of one micro-batch on a rank, E experts.

Design choices:
- Exact, not sampled: the analytic model (analysis/a2a/semantics.py) equals the bytes
  counted at torch.distributed for every dispatcher, bookkeeping included
  (tests/layers/test_a2a_dedup.py), and it is linear in the tokens, each token's cost a
  function of its experts on one rank and on that rank's node. So per training micro-batch
  a rank only adds to a histogram of those two counts (`destination_histogram`, from the
  routing map its dispatcher has just used: a few tensor ops where the map lies, no host
  sync); at log time it turns the histogram into its tokens' [P, P] byte matrices
  (`add_source_histogram`), one all-reduce over the EP group sums them, and the per-call
  bookkeeping (split counts, Megatron's count all-gather) is added times the dispatches.
  Nothing is sent during the step.
- The run's own dispatcher (alltoall = "row", dedup_rank = "rank", dedup_node = "node")
  is reported in full; the other two semantics as what they would send (forward dispatch)
  for the same routing and payload.
- Max and mean over the EP ranks of every EP group of the stage (all-reduce MAX / SUM over
  the expert-data-parallel group, which spans the stage's other EP groups at ETP = 1); per
  layer merged over the pipeline like the routing metrics.
- Node of a rank = global rank // ranks per node (logging.a2a_ranks_per_node, default the
  launcher's LOCAL_WORLD_SIZE); the node semantic's proxies use the dispatcher's node size
  (moe_dispatch_ranks_per_node) or, for what it would send, the EP ranks per node here.
- Layers it cannot model exactly (the allgather dispatcher, expert capacity, ETP > 1,
  MH-MoE sub-tokens) are skipped and named once in the log.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_mvmoe.analysis.a2a.placement import EpPlacement
from megatron_mvmoe.analysis.a2a.semantics import (SEMANTICS, LinkMatrices, add_per_call_bytes,
                                                   add_source_histogram,
                                                   destination_histogram, experts_per_dest,
                                                   payload_for_variant)

MB = 1e6
_OWN = {"alltoall": "row", "dedup_rank": "rank", "dedup_node": "node"}
_PHASES = {"dispatch": ("dispatch_preprocess", "token_dispatch"), "combine": ("token_combine",)}


def ranks_per_node(configured: Optional[int]) -> int:
    """Global ranks per node: the flag, else the launcher's LOCAL_WORLD_SIZE, else 1."""
    return configured or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)


class _Layer:
    """One MoE layer's accumulators on this rank."""

    def __init__(self, layer, own: str, rank_nodes: List[int]) -> None:
        config, dispatcher = layer.config, layer.token_dispatcher
        self.ep, self.rank = dispatcher.ep_size, dispatcher.ep_rank
        dtype_bytes = torch.empty(0, dtype=config.params_dtype).element_size()
        self.payload = payload_for_variant(config.moe_variant, config.hidden_size,
                                           config.latent_size, config.multi_view.num_views,
                                           dtype_bytes)
        experts = config.num_moe_experts
        per_node = rank_nodes.count(rank_nodes[self.rank])
        here = per_node if self.ep % per_node == 0 else self.ep
        dedup_nodes = getattr(dispatcher, "ranks_per_node", None) or here
        self.placements = {s: EpPlacement(self.ep, dedup_nodes if s == own else here, experts)
                           for s in SEMANTICS}
        self.own, self.topk = own, config.moe_router_topk
        self.dispatcher = dispatcher
        self.reset()

    def reset(self) -> None:
        self.hist = None
        self.per_expert = None
        self.calls = 0

    def add(self, routing_map_TE: torch.Tensor) -> None:
        routing_map_TE = routing_map_TE.detach()
        n_TQ = experts_per_dest(routing_map_TE, self.placements["node"])
        hist = destination_histogram(n_TQ, self.placements["node"].ranks_per_node, self.topk)
        counts = routing_map_TE.sum(0)
        self.hist = hist if self.hist is None else self.hist + hist
        self.per_expert = counts if self.per_expert is None else self.per_expert + counts
        self.calls += 1

    def source_matrices(self, semantics: str) -> LinkMatrices:
        """This rank's tokens' forward byte matrices since the last reset."""
        acc = LinkMatrices(self.ep)
        if self.hist is not None:
            add_source_histogram(acc, self.hist.cpu(), self.rank, self.placements[semantics],
                                 self.payload, semantics)
        return acc


def skip_reason(layer) -> Optional[str]:
    """Why the live model would not be exact for this layer, or None."""
    config, dispatcher = layer.config, getattr(layer, "token_dispatcher", None)
    if config.moe_dispatcher not in _OWN or not hasattr(dispatcher, "ep_size"):
        return f"dispatcher {config.moe_dispatcher}"
    if type(dispatcher).__name__ == "MoEAllGatherTokenDispatcher":
        return "the allgather dispatcher"
    if config.moe_expert_capacity_factor is not None:
        return "expert capacity"
    if dispatcher.tp_size > 1:
        return "expert tensor parallelism"
    if config.moe_variant == "mh_moe":
        return "MH-MoE sub-tokens"
    return None


class A2AMonitor:
    """Accumulates every MoE layer's all-to-all bytes on this rank; reduces them at log
    time over the groups of `pg_collection` (collective)."""

    def __init__(self, chunks, pg_collection, configured_ranks_per_node: Optional[int],
                 log_line) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        from megatron_mvmoe.training.metrics import tracker_layer_number

        self.pgs, self.layers, self.handles = pg_collection, {}, []
        self.ranks_per_node = ranks_per_node(configured_ranks_per_node)
        nodes = [g // self.ranks_per_node for g in dist.get_process_group_ranks(
            pg_collection.ep)]
        self.nodes = torch.tensor(nodes)
        skipped = {}
        for chunk in chunks:
            for module in chunk.modules():
                if not isinstance(module, MoELayer):
                    continue
                reason = skip_reason(module)
                if reason:
                    skipped.setdefault(reason, []).append(tracker_layer_number(module))
                    continue
                self._watch(tracker_layer_number(module), module, nodes)
        for reason, numbers in skipped.items():
            log_line(f"a2a metrics: MoE layers {numbers} not measured ({reason} is not "
                     "modelled exactly)")

    @classmethod
    def for_run(cls, run, trainer, pg_collection, log_line) -> Optional["A2AMonitor"]:
        """The monitor a run asks for (logging.a2a_metrics, an MoE model at EP > 1)."""
        if not (run.logging.a2a_metrics and trainer.model_section.is_moe
                and pg_collection.ep.size() > 1):
            return None
        return cls(trainer.unwrapped(), pg_collection, run.logging.a2a_ranks_per_node,
                   log_line)

    def _watch(self, number: int, layer, nodes: List[int]) -> None:
        state = _Layer(layer, _OWN[layer.config.moe_dispatcher], nodes)
        self.layers[number] = state

        def observe(module, args):
            if module.training and torch.is_grad_enabled():
                state.add(state.dispatcher.routing_map)

        self.handles.append(layer.experts.register_forward_pre_hook(observe))

    def reduce(self, steps: int) -> Dict[str, dict]:
        """{"layer_<n>": metrics per step} since the last call, merged over the pipeline."""
        from megatron_mvmoe.training.metrics import _merge_over_pipeline

        mine = {}
        for number, state in sorted(self.layers.items()):
            mine[f"layer_{number}"] = self._layer_metrics(state, max(steps, 1))
            state.reset()
        return _merge_over_pipeline(mine, self.pgs.pp)

    def _full_matrices(self, state: _Layer, semantics: str):
        """{(phase, direction, payload): [P, P]} of the EP group since the last reset."""
        acc = state.source_matrices(semantics)
        keys = sorted(acc.m)
        stacked = torch.stack([acc.m[k] for k in keys]) if keys else torch.zeros(0)
        calls = torch.tensor([state.calls], dtype=torch.long)
        dist.all_reduce(stacked, group=self.pgs.ep)
        dist.all_reduce(calls, op=dist.ReduceOp.MAX, group=self.pgs.ep)
        total = LinkMatrices(state.ep)
        total.m = {k: m for k, m in zip(keys, stacked)}
        add_per_call_bytes(total, state.placements[semantics], semantics, int(calls))
        return total.with_backward()

    def _layer_metrics(self, state: _Layer, steps: int) -> dict:
        matrices = self._full_matrices(state, state.own)
        out = {"semantics": state.own, "per_rank": {}}
        for name, phases in _PHASES.items():
            for direction in ("fwd", "bwd"):
                m = sum((v for (p, d, _), v in matrices.items()
                         if p in phases and d == direction), torch.zeros(state.ep, state.ep,
                                                                         dtype=torch.long))
                key = f"{name}_{direction}"
                out["per_rank"][key] = {"sent": m.sum(1).tolist(), "received": m.sum(0).tolist()}
                out.update(self._spread(key, m, steps))
        dispatch = _dispatch_fwd(matrices, state.ep)
        bookkeeping = sum((v for (p, d, pl), v in matrices.items() if d == "fwd"
                           and pl == "metadata"), torch.zeros_like(dispatch))
        out["dispatch_fwd_bookkeeping_mean"] = self._mean(bookkeeping.sum(1), steps)
        out["inter_node_share"] = self._inter_share(dispatch)
        out["expert_max_over_mean"] = self._expert_spread(state)
        out["would_send"] = {}
        for semantics in SEMANTICS:
            m = dispatch if semantics == state.own else _dispatch_fwd(
                self._full_matrices(state, semantics), state.ep)
            out["would_send"][semantics] = self._mean(m.sum(1), steps)
            out["would_send"][f"{semantics}_inter_node_share"] = self._inter_share(m)
        return out

    def _spread(self, key: str, m: torch.Tensor, steps: int) -> dict:
        """Mean and max over the stage's EP ranks of bytes sent / received per step."""
        out = {}
        for side, per_rank in (("sent", m.sum(1)), ("received", m.sum(0))):
            values = torch.tensor([per_rank.double().max(), per_rank.double().mean()])
            top, total = values[:1].clone(), values[1:].clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=self.pgs.expt_dp)
            dist.all_reduce(total, group=self.pgs.expt_dp)
            mean = float(total) / self.pgs.expt_dp.size()
            out[f"{key}_{side}_mean"] = mean / steps
            out[f"{key}_{side}_max"] = float(top) / steps
            out[f"{key}_{side}_max_over_mean"] = float(top) / mean if mean else 0.0
        return out

    def _mean(self, per_rank: torch.Tensor, steps: int) -> float:
        total = per_rank.double().mean().reshape(1)
        dist.all_reduce(total, group=self.pgs.expt_dp)
        return float(total) / self.pgs.expt_dp.size() / steps

    def _inter_share(self, m: torch.Tensor) -> float:
        """Share of the bytes between ranks (self excluded) that cross a node boundary."""
        cross = self.nodes.unsqueeze(1) != self.nodes.unsqueeze(0)
        other = ~torch.eye(len(self.nodes), dtype=torch.bool)
        parts = torch.tensor([float((m * cross).sum()), float((m * other).sum())],
                             dtype=torch.float64)
        dist.all_reduce(parts, group=self.pgs.expt_dp)
        return float(parts[0] / parts[1]) if parts[1] else 0.0

    def _expert_spread(self, state: _Layer) -> float:
        counts = torch.zeros(state.placements[state.own].num_experts, dtype=torch.float64)
        if state.per_expert is not None:
            counts += state.per_expert.cpu()
        dist.all_reduce(counts, group=self.pgs.ep)
        dist.all_reduce(counts, group=self.pgs.expt_dp)
        mean = float(counts.mean())
        return float(counts.max()) / mean if mean else 0.0

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def _dispatch_fwd(matrices, ranks: int) -> torch.Tensor:
    return sum((v for (p, d, _), v in matrices.items()
                if p in _PHASES["dispatch"] and d == "fwd"),
               torch.zeros(ranks, ranks, dtype=torch.long))


def summary_line(a2a: Dict[str, dict]) -> str:
    """One console line: the layers' mean of the forward dispatch per rank and step."""
    layers = [v for v in a2a.values() if isinstance(v, dict) and "dispatch_fwd_sent_mean" in v]
    if not layers:
        return ""

    def avg(key, inner=None):
        values = [(v[inner] if inner else v)[key] for v in layers]
        return sum(values) / len(values)

    would = "/".join(f"{avg(s, 'would_send') / MB:.3g}" for s in SEMANTICS)
    return (f"a2a ({layers[0]['semantics']}, mean of {len(layers)} MoE layers, per step): "
            f"dispatch fwd sent {avg('dispatch_fwd_sent_mean') / MB:.3g} MB/rank "
            f"(bookkeeping {avg('dispatch_fwd_bookkeeping_mean') / MB:.3g}), recv max/mean "
            f"{avg('dispatch_fwd_received_max_over_mean'):.3f}, inter-node "
            f"{100 * avg('inter_node_share'):.1f}%, expert max/mean "
            f"{avg('expert_max_over_mean'):.2f}; row/rank/node would send {would} MB/rank")
