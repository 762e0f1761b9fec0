"""Count the bytes that really go through the MoE collectives, per call, during forward and
backward: `count_collectives(model)`.

Stable API (tools/a2a_volume.py builds on it):

    with count_collectives(model) as counter:      # model: anything holding MoE layers
        loss = model(...); loss.backward()
    counter.records        # list[CollectiveRecord], in call order
    counter.totals()       # {(layer, phase, direction, payload): input bytes}
    counter.layer_bytes()  # {(layer, phase, direction): input bytes of token payloads}

Each CollectiveRecord has: op (all_to_all_single, all_gather_into_tensor, _all_gather_base,
all_gather, reduce_scatter_tensor, _reduce_scatter_base, reduce_scatter), input_bytes and
output_bytes (this rank's buffers), self_bytes (the part of an all-to-all kept by this rank),
group_size, dtype, shape (of the input), layer (module name of the MoE layer, or None when
the call happened outside a dispatcher), phase (the dispatcher method: dispatch_preprocess,
token_dispatch, dispatch_postprocess, combine_preprocess, token_combine), direction ("fwd" or
"bwd"), payload ("tokens" float rows; "probs": a float vector, or the allgather
dispatcher's dense [T, E] probs; "metadata": int/bool), and peer_bytes (input bytes for each
rank of the group: an all-to-all's splits, an all-gather's input to every rank, a
reduce-scatter's chunks) with group_ranks, from which analysis.a2a.volume splits a rank's
bytes into self / intra-node / inter-node.

Design choices:
- Counting happens at torch.distributed itself (the functions are wrapped for the duration of
  the context, including the aliases Megatron binds at import time), so what is counted is
  what was sent, not what a formula says; results are unchanged (the wrappers only read
  sizes, the autograd markers are identities).
- Attribution: the dispatcher phase methods are wrapped, the ones each dispatcher class
  declares (`counted_phases`; Megatron's classes: their five phases), found on the classes
  of the model's own dispatchers, so a new entry point cannot go unattributed; in
  forward a label is active while
  the method runs; for backward, identity autograd markers on the method's tensor outputs
  set the label when their gradient arrives (just before the collective's backward) and the
  markers on its inputs clear it (just after).
- Expert capacity needs no special case: what is counted is what Megatron's capacity paths
  send (padded to capacity: C rows per expert, padding rows included, equal splits, no split
  metadata; dropping: only the rows left in the routing map), which the analytic model
  states exactly (tests/layers/test_a2a_capacity.py).
- Groups of size 1 never reach torch.distributed (Megatron bypasses them): nothing is
  counted at EP = 1, which is what goes over the wire.
"""

from __future__ import annotations

import contextlib
import inspect
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

_DIST_OPS = ("all_to_all_single", "all_gather_into_tensor", "_all_gather_base", "all_gather",
             "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter")
_MEGATRON_PHASES = ("dispatch_preprocess", "token_dispatch", "dispatch_postprocess",
                    "combine_preprocess", "token_combine")
"""Phase methods of Megatron's own dispatcher classes (which cannot declare them); our
dispatchers declare theirs in a `counted_phases` class attribute."""


@dataclass
class CollectiveRecord:
    op: str
    input_bytes: int
    output_bytes: int
    self_bytes: int
    group_size: int
    dtype: str
    shape: Tuple[int, ...]
    layer: Optional[str]
    phase: Optional[str]
    direction: Optional[str]
    payload: str
    peer_bytes: Tuple[int, ...] = ()
    """all_to_all_single: input bytes for each rank of the group, in group order."""
    group_ranks: Tuple[int, ...] = ()
    """Global ranks of the group (peer_bytes[i] goes to group_ranks[i])."""


class CollectiveCounter:
    """Holds the records and the current attribution label."""

    def __init__(self) -> None:
        self.records: List[CollectiveRecord] = []
        self._forward_labels: List[Tuple[str, str]] = []
        self._backward_label: Optional[Tuple[str, str]] = None
        self._names: Dict[int, str] = {}
        self._hints: Dict[Tuple[str, str], Tuple[int, int]] = {}  # (experts, token width)

    def attach(self, model: Optional[torch.nn.Module]) -> None:
        """Name each dispatcher after the module (MoE layer) holding it."""
        if model is None:
            return
        for name, module in model.named_modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is not None:
                self._names[id(dispatcher)] = name or type(module).__name__

    def layer_name(self, dispatcher) -> str:
        return self._names.get(id(dispatcher), f"{type(dispatcher).__name__}@{id(dispatcher):x}")

    # ---- recording ----------------------------------------------------------------------
    def record(self, op: str, inp, out, group, input_splits=None, output_splits=None) -> None:
        first = inp[0] if isinstance(inp, (list, tuple)) else inp
        in_bytes = _nbytes(inp)
        out_bytes = _nbytes(out)
        size = dist.get_world_size(group)
        self_bytes = _self_bytes(first, size, dist.get_rank(group), input_splits) \
            if op == "all_to_all_single" else 0
        layer, phase, direction = self._label()
        hint = self._hints.get((layer, phase))
        peers = _peer_bytes(op, inp, in_bytes, size, input_splits)
        group_ranks = tuple(dist.get_process_group_ranks(group)) if group is not None \
            else tuple(range(size))
        self.records.append(CollectiveRecord(
            op, in_bytes, out_bytes, self_bytes, size, str(first.dtype).replace("torch.", ""),
            tuple(first.shape), layer, phase, direction, _payload(first, hint), peers,
            group_ranks))

    def _label(self):
        if self._forward_labels:
            return (*self._forward_labels[-1], "fwd")
        if self._backward_label is not None:
            return (*self._backward_label, "bwd")
        return None, None, None

    # ---- summaries ----------------------------------------------------------------------
    def totals(self) -> Dict[Tuple, int]:
        """Input bytes summed by (layer, phase, direction, payload)."""
        sums: Dict[Tuple, int] = defaultdict(int)
        for r in self.records:
            sums[(r.layer, r.phase, r.direction, r.payload)] += r.input_bytes
        return dict(sums)

    def layer_bytes(self, op: str = "all_to_all_single") -> Dict[Tuple, int]:
        """Token bytes through `op` by (layer, phase, direction)."""
        sums: Dict[Tuple, int] = defaultdict(int)
        for r in self.records:
            if r.op == op and r.payload == "tokens":
                sums[(r.layer, r.phase, r.direction)] += r.input_bytes
        return dict(sums)


# ---- torch.distributed wrappers -------------------------------------------------------------
def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(x.numel() * x.element_size() for x in t)
    return t.numel() * t.element_size()


def _self_bytes(inp: torch.Tensor, size: int, rank: int, splits) -> int:
    row_bytes = inp[0].numel() * inp.element_size() if inp.dim() and inp.shape[0] else 0
    rows = inp.shape[0] // size if splits is None else int(list(splits)[rank])
    return rows * row_bytes


def _peer_bytes(op: str, inp, in_bytes: int, size: int, splits) -> Tuple[int, ...]:
    """Input bytes this rank hands over for each rank of the group: an all-to-all's splits,
    an all-gather's whole input to every rank, a reduce-scatter's chunks (list elements, or
    equal parts of one tensor)."""
    if op == "all_to_all_single":
        row_bytes = inp[0].numel() * inp.element_size() if inp.dim() and inp.shape[0] else 0
        rows = [inp.shape[0] // size] * size if splits is None else [int(x) for x in splits]
        return tuple(r * row_bytes for r in rows)
    if "gather" in op:
        return (in_bytes,) * size
    if isinstance(inp, (list, tuple)):
        return tuple(_nbytes(x) for x in inp)
    return (in_bytes // size,) * size


def _payload(t: torch.Tensor, hint) -> str:
    """metadata (int/bool), probs (1-D, or the allgather dispatcher's dense [T, E] whose
    width is the expert count and not the token width), else tokens."""
    if not t.is_floating_point():
        return "metadata"
    if t.dim() == 1:
        return "probs"
    if hint is not None:
        num_experts, token_width = hint
        if t.shape[-1] == num_experts and t.shape[-1] != token_width:
            return "probs"
    return "tokens"


def _wrap_dist_op(counter: CollectiveCounter, name: str, original):
    """Record sizes, then call the original with the caller's exact arguments."""
    signature = inspect.signature(original)
    names = list(signature.parameters)  # (output, input, ...) for every op counted here

    def wrapped(*args, **kwargs):
        bound = signature.bind(*args, **kwargs).arguments
        out, inp = bound[names[0]], bound[names[1]]
        counter.record(name, inp, out, bound.get("group"), bound.get("input_split_sizes"),
                       bound.get("output_split_sizes"))
        return original(*args, **kwargs)

    return wrapped


# ---- attribution markers -------------------------------------------------------------------
class _BackwardMarker(torch.autograd.Function):
    """Identity in forward; in backward, `_on_backward` moves the counter's label (the
    gradient passes through unchanged)."""

    @staticmethod
    def forward(ctx, x, counter, label):
        ctx.counter, ctx.label = counter, label
        return x.view_as(x)

    @classmethod
    def backward(cls, ctx, grad):
        cls._on_backward(ctx.counter, ctx.label)
        return grad, None, None

    @staticmethod
    def _on_backward(counter, label) -> None:
        raise NotImplementedError


class _EnterOnBackward(_BackwardMarker):
    @staticmethod
    def _on_backward(counter, label) -> None:
        counter._backward_label = label


class _ExitOnBackward(_BackwardMarker):
    @staticmethod
    def _on_backward(counter, label) -> None:
        if counter._backward_label == label:
            counter._backward_label = None


def _mark(value, marker, counter, label):
    if torch.is_tensor(value) and value.requires_grad:
        return marker.apply(value, counter, label)
    if isinstance(value, tuple):
        return tuple(_mark(v, marker, counter, label) for v in value)
    return value


def _wrap_phase(counter: CollectiveCounter, phase: str, original):
    def wrapped(dispatcher, *args, **kwargs):
        label = (counter.layer_name(dispatcher), phase)
        if args and torch.is_tensor(args[0]) and args[0].dim() >= 2:
            counter._hints[label] = (dispatcher.config.num_moe_experts, args[0].shape[-1])
        args = _mark(args, _ExitOnBackward, counter, label)
        counter._forward_labels.append(label)
        try:
            out = original(dispatcher, *args, **kwargs)
        finally:
            counter._forward_labels.pop()
        return _mark(out, _EnterOnBackward, counter, label)

    return wrapped


def _default_dispatcher_classes():
    from megatron.core.transformer.moe import token_dispatcher as td

    from megatron_mvmoe.layers.dedup_dispatcher import DedupAlltoAllTokenDispatcher
    from megatron_mvmoe.layers.per_row_dispatcher import PerRowAlltoAllTokenDispatcher

    return [td.MoEAlltoAllTokenDispatcher, td.MoEAllGatherTokenDispatcher,
            PerRowAlltoAllTokenDispatcher, DedupAlltoAllTokenDispatcher]


def declared_phases(cls) -> Tuple[str, ...]:
    """The phase methods `cls` itself defines and declares: `counted_phases` in its own
    body, or Megatron's phase names for Megatron's classes."""
    declared = cls.__dict__.get("counted_phases")
    if declared is None and cls.__module__.startswith("megatron.core"):
        declared = _MEGATRON_PHASES
    return tuple(name for name in (declared or ()) if name in cls.__dict__)


def _dispatcher_classes(model: Optional[torch.nn.Module]):
    """Every class (with its bases) of the model's dispatchers, and the known ones."""
    found = list(_default_dispatcher_classes())
    if model is not None:
        for module in model.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is not None:
                found += type(dispatcher).__mro__
    return list(dict.fromkeys(found))


@contextlib.contextmanager
def count_collectives(model: Optional[torch.nn.Module] = None):
    """Count every MoE collective inside the block; yields the CollectiveCounter."""
    from megatron.core.tensor_parallel import mappings

    counter = CollectiveCounter()
    counter.attach(model)
    saved = []  # (owner, attribute, original)

    def patch(owner, attr, value):
        saved.append((owner, attr, owner.__dict__[attr] if isinstance(owner, type)
                      else getattr(owner, attr)))
        setattr(owner, attr, value)

    try:
        for name in _DIST_OPS:
            if hasattr(dist, name):
                patch(dist, name, _wrap_dist_op(counter, name, getattr(dist, name)))
        for alias in ("dist_all_gather_func", "dist_reduce_scatter_func"):
            original = getattr(mappings, alias)
            patch(mappings, alias, _wrap_dist_op(counter, original.__name__, original))
        for cls in _dispatcher_classes(model):
            for phase in declared_phases(cls):
                patch(cls, phase, _wrap_phase(counter, phase, cls.__dict__[phase]))
        yield counter
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)
