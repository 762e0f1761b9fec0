"""Live all-to-all metrics: per MoE layer and log interval, the bytes each EP rank sends and
receives in the dispatch and combine, forward and backward, from the routing maps the run
already has (`A2AMonitor`).

Legend: P EP ranks, T tokens of one micro-batch on a rank, E experts.

Design choices:
- Exact, not sampled: the analytic model (a2a_model/semantics.py) equals the bytes
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

from megatron_mvmoe.a2a_model.placement import EpPlacement
from megatron_mvmoe.a2a_model.semantics import (SEMANTICS, LinkMatrices, add_per_call_bytes,
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

    @property
    def num_experts(self) -> int:
        return self.placements[self.own].num_experts

    def expert_counts(self) -> torch.Tensor:
        """Tokens per expert routed by this rank since the last reset (int64, CPU)."""
        if self.per_expert is None:
            return torch.zeros(self.num_experts, dtype=torch.long)
        return self.per_expert.cpu().long()

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
        node = torch.tensor(nodes)
        self._cross = node.unsqueeze(1) != node.unsqueeze(0)  # [P, P]: crosses a node
        self._between = ~torch.eye(len(nodes), dtype=torch.bool)  # [P, P]: not to itself
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
        """{"layer_<n>": metrics per step} since the last call, merged over the pipeline.
        Collective: one all-reduce over the EP group (every layer's matrices and expert
        counts at once), one SUM and one MAX over the expert-data-parallel group."""
        from megatron_mvmoe.training.metrics import _merge_over_pipeline

        layers = sorted(self.layers.items())
        full, experts = self._ep_sums(layers)
        stats = _Stats()
        for number, state in layers:
            self._layer_stats(stats, number, state, full, experts[number])
        stats.reduce(self.pgs.expt_dp)
        mine = {f"layer_{number}": self._layer_metrics(stats, number, state, full, steps)
                for number, state in layers}
        for _, state in layers:
            state.reset()
        return _merge_over_pipeline(mine, self.pgs.pp)

    def _ep_sums(self, layers):
        """{(layer, semantics): {(phase, direction, payload): [P, P]}} of each EP group since
        the last reset (bookkeeping per call included), and {layer: tokens per expert}."""
        pieces, flat = [], []
        for number, state in layers:
            for semantics in SEMANTICS:
                acc = state.source_matrices(semantics)
                pieces.append((number, semantics, sorted(acc.m)))
                flat += [acc.m[k].flatten() for k in pieces[-1][2]]
            flat.append(state.expert_counts())
        buffer = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.long)
        dist.all_reduce(buffer, group=self.pgs.ep)
        full, experts, at = {}, {}, 0
        by_layer = dict(layers)
        for number, state in layers:
            ranks = state.ep
            for semantics in SEMANTICS:
                keys = next(k for n, s, k in pieces if (n, s) == (number, semantics))
                total = LinkMatrices(ranks)
                total.m = {}
                for key in keys:
                    total.m[key] = buffer[at:at + ranks * ranks].view(ranks, ranks)
                    at += ranks * ranks
                add_per_call_bytes(total, state.placements[semantics], semantics, state.calls)
                full[(number, semantics)] = total.with_backward()
            size = by_layer[number].num_experts
            experts[number] = buffer[at:at + size].double()
            at += size
        return full, experts

    def _layer_stats(self, stats, number: int, state: _Layer, full, experts) -> None:
        """This EP group's figures of one layer, to sum or max over the stage."""
        matrices = full[(number, state.own)]
        for key, m in _phase_matrices(matrices, state.ep).items():
            for side, per_rank in (("sent", m.sum(1)), ("received", m.sum(0))):
                stats.add((number, f"{key}_{side}_mean"), per_rank.double().mean())
                stats.top((number, f"{key}_{side}_max"), per_rank.double().max())
        bookkeeping = sum((v for (p, d, pl), v in matrices.items() if d == "fwd"
                           and pl == "metadata"), torch.zeros(state.ep, state.ep, dtype=torch.long))
        stats.add((number, "bookkeeping"), bookkeeping.sum(1).double().mean())
        for semantics in SEMANTICS:
            m = _dispatch_fwd(full[(number, semantics)], state.ep)
            stats.add((number, semantics), m.sum(1).double().mean())
            stats.add((number, semantics, "cross"), (m * self._cross).sum().double())
            stats.add((number, semantics, "between"), (m * self._between).sum().double())
        stats.add((number, "experts"), experts)

    def _layer_metrics(self, stats, number: int, state: _Layer, full, steps: int) -> dict:
        groups = self.pgs.expt_dp.size()
        out = {"semantics": state.own, "per_rank": {}}
        for key, m in _phase_matrices(full[(number, state.own)], state.ep).items():
            out["per_rank"][key] = {"sent": m.sum(1).tolist(), "received": m.sum(0).tolist()}
            for side in ("sent", "received"):
                mean = float(stats.sums[(number, f"{key}_{side}_mean")]) / groups
                top = float(stats.maxes[(number, f"{key}_{side}_max")])
                out[f"{key}_{side}_mean"] = mean / steps
                out[f"{key}_{side}_max"] = top / steps
                out[f"{key}_{side}_max_over_mean"] = top / mean if mean else 0.0
        out["dispatch_fwd_bookkeeping_mean"] = float(stats.sums[(number, "bookkeeping")]) / (
            groups * steps)
        out["would_send"] = {}
        for semantics in SEMANTICS:
            between = float(stats.sums[(number, semantics, "between")])
            share = float(stats.sums[(number, semantics, "cross")]) / between if between else 0.0
            out["would_send"][semantics] = float(stats.sums[(number, semantics)]) / (
                groups * steps)
            out["would_send"][f"{semantics}_inter_node_share"] = share
        out["inter_node_share"] = out["would_send"][f"{state.own}_inter_node_share"]
        counts = stats.sums[(number, "experts")]
        mean = float(counts.mean())
        out["expert_max_over_mean"] = float(counts.max()) / mean if mean else 0.0
        return out

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


class _Stats:
    """Named figures to sum or to max over a group, reduced in one all-reduce each."""

    def __init__(self) -> None:
        self.sums: Dict = {}
        self.maxes: Dict = {}

    def add(self, name, value: torch.Tensor) -> None:
        self.sums[name] = value.double().reshape(-1)

    def top(self, name, value: torch.Tensor) -> None:
        self.maxes[name] = value.double().reshape(-1)

    def reduce(self, group) -> None:
        for values, op in ((self.sums, dist.ReduceOp.SUM), (self.maxes, dist.ReduceOp.MAX)):
            names = list(values)
            sizes = [values[n].numel() for n in names]
            packed = torch.cat([values[n] for n in names]) if names else torch.zeros(0)
            dist.all_reduce(packed, op=op, group=group)
            for name, part in zip(names, packed.split(sizes)):
                values[name] = part if part.numel() > 1 else part[0]


def _phase_matrices(matrices, ranks: int) -> Dict[str, torch.Tensor]:
    """{dispatch_fwd, dispatch_bwd, combine_fwd, combine_bwd: [P, P]} over all payloads."""
    out = {}
    for name, phases in _PHASES.items():
        for direction in ("fwd", "bwd"):
            out[f"{name}_{direction}"] = sum(
                (v for (p, d, _), v in matrices.items() if p in phases and d == direction),
                torch.zeros(ranks, ranks, dtype=torch.long))
    return out


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
