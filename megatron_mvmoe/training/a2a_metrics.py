"""Live all-to-all metrics: per MoE layer and log interval, the bytes each EP rank sends and
receives in the dispatch and combine, forward and backward, from the routing maps the run
already has (`A2AMonitor`).

Legend: P EP ranks, R = ETP x P ranks of the TP x EP group, T tokens of one micro-batch on a
rank, E experts.

Design choices:
- Exact, not sampled: the analytic model (a2a_model/semantics.py) equals the bytes
  counted at torch.distributed for every dispatcher, bookkeeping included
  (tests/layers/test_a2a_dedup.py), and it is linear in the tokens, each token's cost a
  function of its experts on one rank and on that rank's node. So per training micro-batch
  a rank only adds to a histogram of those two counts (`destination_histogram`, from the
  routing map its dispatcher has just used: a few tensor ops where the map lies, no host
  sync); at log time it turns the histogram into its tokens' byte matrices
  (`add_source_histogram`) plus its per-call bookkeeping (split counts, Megatron's count
  all-gather) times its dispatches, and one all-reduce over the TP x EP group sums them.
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
- Every dispatcher the trainer runs: the alltoall rows (MH-MoE: sub-token rows of D/H;
  expert capacity: the kept or padded rows of the routing map, no count all-gather when
  padded), the dedup dispatchers, and Megatron's allgather dispatcher (its rank's token
  count is all it needs: `add_allgather_source`). At expert TP > 1 the matrices span the
  TP x EP group: the EP all-to-alls plus the expert-TP all-gather / reduce-scatter, which
  follow from the all-to-all sums (`add_expert_tp_collectives`). Probs are counted in the
  dtype the router returned. Only router padding for quantization is skipped (named once).
- Device-agnostic: the histogram is built where the routing map lies; the log-time
  all-reduces run on the model's device (NCCL needs device tensors) and come back to the
  CPU.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_mvmoe.a2a_model.placement import EpPlacement
from megatron_mvmoe.a2a_model.semantics import (SEMANTICS, LinkMatrices,
                                                   add_allgather_source,
                                                   add_expert_tp_collectives,
                                                   add_source_histogram,
                                                   destination_histogram, experts_per_dest,
                                                   payload_for_variant, per_call_bookkeeping)

MB = 1e6
_OWN = {"alltoall": "row", "dedup_rank": "rank", "dedup_node": "node"}
_PHASES = {"dispatch": ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess"),
           "combine": ("combine_preprocess", "token_combine")}


def ranks_per_node(configured: Optional[int]) -> int:
    """Global ranks per node: the flag, else the launcher's LOCAL_WORLD_SIZE, else 1."""
    return configured or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)


def _positions(group, members: List[int]) -> torch.Tensor:
    """Where the ranks of `group` sit in `members` (global ranks in group order)."""
    return torch.tensor([members.index(g) for g in dist.get_process_group_ranks(group)])


class _Layer:
    """One MoE layer's accumulators on this rank. Its matrices span the dispatcher's
    TP x EP group (R = ETP * EP ranks, = the EP group at ETP = 1): the EP all-to-alls
    between ranks of one expert-TP index, the expert-TP collectives inside an ETP group."""

    def __init__(self, layer, own: str, node_of) -> None:
        config, dispatcher = layer.config, layer.token_dispatcher
        self.dispatcher, self.own = dispatcher, own
        self.ep, self.etp, self.ep_rank = dispatcher.ep_size, dispatcher.tp_size, dispatcher.ep_rank
        self.group = dispatcher.tp_ep_group
        self.members = dist.get_process_group_ranks(self.group)
        self.me = self.members.index(dist.get_rank())
        self.ep_positions = _positions(dispatcher.ep_group, self.members)
        self.etp_positions = _positions(dispatcher.tp_group, self.members)
        # at ETP = 1 the TP x EP group is the EP group in EP order: no embedding needed
        self.embed = not torch.equal(self.ep_positions, torch.arange(len(self.members)))
        nodes = torch.tensor([node_of(g) for g in self.members])
        self.cross = nodes.unsqueeze(1) != nodes.unsqueeze(0)  # [R, R]: crosses a node
        self.between = ~torch.eye(len(self.members), dtype=torch.bool)  # not to itself
        dtype_bytes = torch.empty(0, dtype=config.params_dtype).element_size()
        self.payload = payload_for_variant(config.moe_variant, config.hidden_size,
                                           config.latent_size, config.multi_view.num_views,
                                           dtype_bytes)
        self.padded = bool(config.moe_pad_expert_input_to_capacity)
        experts = config.num_moe_experts
        ep_nodes = [node_of(self.members[p]) for p in self.ep_positions.tolist()]
        per_node = ep_nodes.count(ep_nodes[self.ep_rank])
        here = per_node if self.ep % per_node == 0 else self.ep
        dedup_nodes = getattr(dispatcher, "ranks_per_node", None) or here
        self.placements = {s: EpPlacement(self.ep, dedup_nodes if s == own else here, experts)
                           for s in SEMANTICS}
        self.semantics = SEMANTICS if own in SEMANTICS else (*SEMANTICS, own)
        self.topk = config.moe_router_topk
        self.reset()

    def reset(self) -> None:
        self.hist = None
        self.per_expert = None
        self.calls = 0
        self.tokens = 0

    def add(self, routing_map_TE: torch.Tensor, probs: Optional[torch.Tensor]) -> None:
        routing_map_TE = routing_map_TE.detach()
        if probs is not None and probs.element_size() != self.payload.probs_bytes:
            self.payload = replace(self.payload, probs_bytes=probs.element_size())
        n_TQ = experts_per_dest(routing_map_TE, self.placements["node"])
        hist = destination_histogram(n_TQ, self.placements["node"].ranks_per_node, self.topk)
        counts = routing_map_TE.sum(0)
        self.hist = hist if self.hist is None else self.hist + hist
        self.per_expert = counts if self.per_expert is None else self.per_expert + counts
        self.calls += 1
        self.tokens += routing_map_TE.shape[0]

    @property
    def num_experts(self) -> int:
        return self.placements["row"].num_experts

    @property
    def ranks(self) -> int:
        return len(self.members)

    def expert_counts(self) -> torch.Tensor:
        """Tokens per expert routed by this rank since the last reset (int64, CPU)."""
        if self.per_expert is None:
            return torch.zeros(self.num_experts, dtype=torch.long)
        return self.per_expert.cpu().long()

    def etp_peers(self) -> torch.Tensor:
        """[R, R] with this rank's row of the expert-TP membership (summed over the group:
        all of it)."""
        peers = torch.zeros(self.ranks, self.ranks, dtype=torch.long)
        peers[self.me, self.etp_positions] = 1
        return peers

    def source_matrices(self, semantics: str) -> LinkMatrices:
        """What this rank's tokens and dispatches since the last reset put on the [R, R]
        links (the forward), per-dispatch bookkeeping included."""
        acc = LinkMatrices(self.ranks)
        if semantics == "allgather":
            add_allgather_source(acc, self.me, self.tokens, self.payload, self.num_experts)
            return acc
        placement = self.placements[semantics]
        if self.hist is not None:
            on_ep = LinkMatrices(self.ep) if self.embed else acc
            add_source_histogram(on_ep, self.hist.cpu(), self.ep_rank, placement,
                                 self.payload, semantics)
            if self.embed:
                self._embed(on_ep, acc)
        # Megatron's counts go to the TP x EP group, the dedup split counts to the EP group
        dests = slice(None) if semantics == "row" else self.ep_positions
        acc.add("dispatch_preprocess" if semantics == "row" else "token_dispatch", "metadata",
                self.me, dests, self.calls * per_call_bookkeeping(
                    placement, semantics, padded=self.padded and semantics == self.own))
        return acc

    def _embed(self, on_ep: LinkMatrices, acc: LinkMatrices) -> None:
        """Adds [P, P] EP matrices into the [R, R] TP x EP ones at the EP ranks' places."""
        at = self.ep_positions
        for key, matrix in on_ep.m.items():
            acc.m.setdefault(key, torch.zeros(self.ranks, self.ranks, dtype=torch.long))
            acc.m[key][at.unsqueeze(1), at.unsqueeze(0)] += matrix


def skip_reason(layer) -> Optional[str]:
    """Why the live model would not be exact for this layer, or None."""
    from megatron.core.transformer.moe.token_dispatcher import (MoEAllGatherTokenDispatcher,
                                                                 MoEAlltoAllTokenDispatcher)

    config, dispatcher = layer.config, getattr(layer, "token_dispatcher", None)
    if config.moe_dispatcher not in _OWN or not isinstance(
            dispatcher, (MoEAlltoAllTokenDispatcher, MoEAllGatherTokenDispatcher)):
        return f"dispatcher {config.moe_dispatcher} ({type(dispatcher).__name__})"
    if config.moe_router_padding_for_quantization:
        return "router padding for quantization"
    return None


def own_semantics(layer) -> str:
    """What the layer's dispatcher sends: allgather, or row / rank / node (all-to-all)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

    if isinstance(layer.token_dispatcher, MoEAllGatherTokenDispatcher):
        return "allgather"
    return _OWN[layer.config.moe_dispatcher]


class A2AMonitor:
    """Accumulates every MoE layer's all-to-all bytes on this rank; reduces them at log
    time over the groups of `pg_collection` (collective)."""

    def __init__(self, chunks, pg_collection, configured_ranks_per_node: Optional[int],
                 log_line) -> None:
        from megatron.core.transformer.moe.moe_layer import MoELayer

        from megatron_mvmoe.training.metrics import tracker_layer_number

        self.pgs, self.layers, self.handles = pg_collection, {}, []
        # the collectives' device: where the model lies (CUDA tensors for NCCL, CPU for gloo)
        self.device = next((p.device for chunk in chunks for p in chunk.parameters()),
                           torch.device("cpu"))
        self.ranks_per_node = ranks_per_node(configured_ranks_per_node)
        skipped = {}
        for chunk in chunks:
            for module in chunk.modules():
                if not isinstance(module, MoELayer):
                    continue
                reason = skip_reason(module)
                if reason:
                    skipped.setdefault(reason, []).append(tracker_layer_number(module))
                    continue
                self._watch(tracker_layer_number(module), module)
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

    def _watch(self, number: int, layer) -> None:
        state = _Layer(layer, own_semantics(layer), lambda g: g // self.ranks_per_node)
        self.layers[number] = state
        dispatcher = state.dispatcher

        def observe(module, args):  # the map the all-to-all dispatcher has just used
            if module.training and torch.is_grad_enabled():
                state.add(dispatcher.routing_map, getattr(dispatcher, "probs", None))

        def observe_router(module, args, output):  # the allgather dispatcher drops its map
            if module.training and torch.is_grad_enabled():
                state.add(output[1], output[0])

        if state.own == "allgather":
            self.handles.append(layer.router.register_forward_hook(observe_router))
        else:
            self.handles.append(layer.experts.register_forward_pre_hook(observe))

    def reduce(self, steps: int) -> Dict[str, dict]:
        """{"layer_<n>": metrics per step} since the last call, merged over the pipeline.
        Collective: one all-reduce over the TP x EP group (every layer's matrices and expert
        counts at once), one SUM and one MAX over the expert-data-parallel group."""
        from megatron_mvmoe.training.metrics import _merge_over_pipeline

        layers = sorted(self.layers.items())
        full, experts = self._group_sums(layers)
        phases = {number: _phase_matrices(full[(number, state.own)], state.ranks)
                  for number, state in layers}
        stats = _Stats()
        for number, state in layers:
            self._layer_stats(stats, number, state, full, phases[number], experts[number])
        stats.reduce(self.pgs.expt_dp, self.device)
        mine = {f"layer_{number}": self._layer_metrics(stats, number, state, phases[number],
                                                       steps)
                for number, state in layers}
        for _, state in layers:
            state.reset()
        return _merge_over_pipeline(mine, self.pgs.pp)

    def _group_sums(self, layers):
        """{(layer, semantics): {(phase, direction, payload): [R, R]}} of each TP x EP group
        since the last reset, and {layer: tokens per expert}: every rank adds what its own
        tokens and calls cost, one all-reduce sums them; the expert-TP collectives follow
        from the all-to-all sums."""
        pieces, flat = [], []
        for number, state in layers:
            for semantics in state.semantics:
                acc = state.source_matrices(semantics)
                pieces.append(sorted(acc.m))
                flat += [acc.m[k].flatten() for k in pieces[-1]]
            flat.append(state.expert_counts())
            if state.etp > 1:
                flat.append(state.etp_peers().flatten())
        buffer = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.long)
        buffer = _all_reduced(buffer, layers[0][1].group if layers else self.pgs.ep,
                              self.device)
        full, experts, at, piece = {}, {}, 0, iter(pieces)

        def take(size):
            nonlocal at
            at += size
            return buffer[at - size:at]

        for number, state in layers:
            ranks = state.ranks
            for semantics in state.semantics:
                total = LinkMatrices(ranks)
                total.m = {key: take(ranks * ranks).view(ranks, ranks) for key in next(piece)}
                full[(number, semantics)] = total
            experts[number] = take(state.num_experts).double()
            if state.etp > 1:  # only Megatron's rows have an expert-TP path
                peers = take(ranks * ranks).view(ranks, ranks)
                add_expert_tp_collectives(full[(number, "row")], peers, state.payload)
            for semantics in state.semantics:
                full[(number, semantics)] = full[(number, semantics)].with_backward()
        return full, experts

    def _layer_stats(self, stats, number: int, state: _Layer, full, phases, experts) -> None:
        """This TP x EP group's figures of one layer, to sum or max over the stage. Stacked:
        a few ops per layer, not a few per (phase, side) and semantics, since at the default
        log_interval 1 this runs every step (integer-valued doubles: the sums are exact, so
        the figures equal the per-matrix ones)."""
        per_rank = _sent_and_received(phases)  # [2 x phases, R]
        stats.add((number, "phase_means"), per_rank.mean(1))
        stats.top((number, "phase_maxes"), per_rank.max(1).values)
        matrices = full[(number, state.own)]
        bookkeeping = sum((v for (p, d, pl), v in matrices.items() if d == "fwd"
                           and pl == "metadata"),
                          torch.zeros(state.ranks, state.ranks, dtype=torch.long))
        stats.add((number, "bookkeeping"), bookkeeping.sum(1).double().mean())
        sends_SRR = torch.stack([_dispatch_fwd(full[(number, semantics)], state.ranks)
                                 for semantics in state.semantics]).double()
        stats.add((number, "would_send"), sends_SRR.sum(2).mean(1))
        stats.add((number, "cross"), (sends_SRR * state.cross).sum((1, 2)))
        stats.add((number, "between"), (sends_SRR * state.between).sum((1, 2)))
        stats.add((number, "experts"), experts)

    def _layer_metrics(self, stats, number: int, state: _Layer, phases, steps: int) -> dict:
        groups = self.pgs.expt_dp.size()
        means = stats.sums[(number, "phase_means")].reshape(-1).tolist()
        tops = stats.maxes[(number, "phase_maxes")].reshape(-1).tolist()
        out = {"semantics": state.own, "per_rank": {}}
        for index, (key, m) in enumerate(phases.items()):
            out["per_rank"][key] = {"sent": m.sum(1).tolist(), "received": m.sum(0).tolist()}
            for offset, side in enumerate(("sent", "received")):
                mean, top = means[2 * index + offset] / groups, tops[2 * index + offset]
                out[f"{key}_{side}_mean"] = mean / steps
                out[f"{key}_{side}_max"] = top / steps
                out[f"{key}_{side}_max_over_mean"] = top / mean if mean else 0.0
        out["dispatch_fwd_bookkeeping_mean"] = float(stats.sums[(number, "bookkeeping")]) / (
            groups * steps)
        out["would_send"] = {}
        sends, crosses, betweens = (stats.sums[(number, name)].reshape(-1).tolist()
                                    for name in ("would_send", "cross", "between"))
        for index, semantics in enumerate(state.semantics):
            between = betweens[index]
            share = crosses[index] / between if between else 0.0
            out["would_send"][semantics] = sends[index] / (groups * steps)
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

    def reduce(self, group, device: torch.device) -> None:
        for values, op in ((self.sums, dist.ReduceOp.SUM), (self.maxes, dist.ReduceOp.MAX)):
            names = list(values)
            sizes = [values[n].numel() for n in names]
            packed = torch.cat([values[n] for n in names]) if names else torch.zeros(0)
            packed = _all_reduced(packed, group, device, op)
            for name, part in zip(names, packed.split(sizes)):
                values[name] = part if part.numel() > 1 else part[0]


def _all_reduced(values: torch.Tensor, group, device: torch.device,
                 op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`values` reduced over `group`, the collective run on `device` (NCCL takes only
    device tensors), returned on the CPU where the metrics are assembled."""
    on_device = values.to(device)
    dist.all_reduce(on_device, op=op, group=group)
    return on_device.cpu()


def _phase_matrices(matrices, ranks: int) -> Dict[str, torch.Tensor]:
    """{dispatch_fwd, dispatch_bwd, combine_fwd, combine_bwd: [P, P]} over all payloads."""
    out = {}
    for name, phases in _PHASES.items():
        for direction in ("fwd", "bwd"):
            out[f"{name}_{direction}"] = sum(
                (v for (p, d, _), v in matrices.items() if p in phases and d == direction),
                torch.zeros(ranks, ranks, dtype=torch.long))
    return out


def _sent_and_received(phases: Dict[str, torch.Tensor]) -> torch.Tensor:
    """[2 x phases, R] doubles: each phase's bytes sent per rank, then received per rank."""
    return torch.stack([m.sum(dim) for m in phases.values() for dim in (1, 0)]).double()


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
