"""Controlled mixing interventions (seed 000, "Controlled Mixing Interventions"): at one
Multi-View layer, hold the selected set S and the output gates g fixed and replace only the
view-mixing proportions a_{m,i}; report the held-out NLL change per domain.

Legend: T tokens (flattened [S, B] order), E experts, S selected slots, R routing heads
(= K views), L latent size.

Design choices:
- Hook points: MultiViewMoELayer's public phase methods, wrapped on the INSTANCE from
  outside (no edit of the layer): `expert_rows(views_TRL, mix_TSR)` receives the layer's
  mixing weights and returns the per-slot rows, so replacing `mix_TSR` there changes only
  the expert inputs; `route(...)` is wrapped read-only to record (probs_TE, routing_map_TE)
  so every intervention run is checked against the baseline run: selection and gates must
  be EQUAL (torch.equal), not just close.
- Policies (all rows stay convex combinations):
    identity  a unchanged (the control: ΔNLL must be exactly 0)
    view1     a = e_1 (each expert sees only the backbone view P h)
    view2     a = e_2 (only the second view)
    uniform   a = 1/R
    swapped   a reversed over heads (R = 2: a_1 <-> a_2)
- Everything runs under no_grad in eval mode; the model and its routers are left as found.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Sequence, Tuple

import torch

from megatron_mvmoe.views.protocols import ViewMixing

POLICIES = ("identity", "view1", "view2", "uniform", "swapped")


def replace_mixing(mix_TSR: torch.Tensor, policy: str) -> torch.Tensor:
    """New mixing weights [T, S, R] for `policy` (see module docstring)."""
    num_heads = mix_TSR.shape[-1]
    if policy == "identity":
        return mix_TSR
    if policy == "uniform":
        return torch.full_like(mix_TSR, 1.0 / num_heads)
    if policy == "swapped":
        return mix_TSR.flip(-1)
    if policy.startswith("view") and policy[4:].isdigit():
        view = int(policy[4:]) - 1
        if not 0 <= view < num_heads:
            raise ValueError(f"policy: {policy!r} needs at least {view + 1} views, the layer "
                             f"has {num_heads}. Fix: use view1..view{num_heads}")
        return torch.nn.functional.one_hot(
            torch.full(mix_TSR.shape[:-1], view, dtype=torch.long, device=mix_TSR.device),
            num_heads).to(mix_TSR.dtype)
    raise ValueError(f"policy: unknown {policy!r}. Fix: use one of {POLICIES} or viewN")


@dataclass
class RoutingLog:
    """(probs_TE, routing_map_TE) of every forward of one layer, in call order."""

    calls: List[Tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


@contextlib.contextmanager
def override_mixing(layer, policy: str) -> Iterator[RoutingLog]:
    """Replace `layer`'s mixing weights by `policy` and record its routing, inside the block."""
    _require_multi_view(layer)
    replace_mixing(torch.full((1, 1, layer.config.multi_view.num_views), 0.5), policy)
    log = RoutingLog()

    def record(routing) -> None:  # a MultiRouter observer: every routing step
        log.calls.append((routing.probs_TE.detach().clone(), routing.routing_map_TE.clone()))

    def transform(mix_TSR):
        return replace_mixing(mix_TSR, policy)

    # both hooks are declared by the classes they observe (router.observers,
    # layer.mix_transforms): nothing is patched on the instances
    layer.router.observers.append(record)
    layer.mix_transforms.append(transform)
    try:
        yield log
    finally:
        layer.router.observers.remove(record)
        layer.mix_transforms.remove(transform)


def _require_multi_view(layer) -> None:
    if not isinstance(layer, ViewMixing):
        raise ValueError(f"layer: {type(layer).__name__} mixes no views. Fix: pick a "
                         "layer of a variant that mixes views (moe_variant='multi_view')")
    if layer.config.multi_view.num_views < 2:
        raise ValueError("layer: num_views = 1, nothing to intervene on. Fix: use a "
                         "Multi-View model with num_views = num_routers >= 2")


@dataclass
class DomainEffect:
    """NLL of one domain under one policy."""

    domain: str
    nll_base: float
    """Mean per-token NLL of the unmodified model."""
    nll: float
    """Mean per-token NLL with the intervention."""
    tokens: int

    @property
    def delta(self) -> float:
        return self.nll - self.nll_base

    def as_dict(self) -> dict:
        return {"domain": self.domain, "nll_base": self.nll_base, "nll": self.nll,
                "delta_nll": self.delta, "tokens": self.tokens}


@dataclass
class PolicyResult:
    """One policy at one layer, over every domain."""

    policy: str
    domains: List[DomainEffect]
    selection_fixed: bool
    """Every forward's routing map equal to the baseline's."""
    max_gate_diff: float
    """Largest |probs - baseline probs| over all forwards (0.0 when gates are fixed)."""

    def as_dict(self) -> dict:
        return {"policy": self.policy, "domains": [d.as_dict() for d in self.domains],
                "selection_fixed": self.selection_fixed, "max_gate_diff": self.max_gate_diff}


NllFn = Callable[[torch.nn.Module, object], torch.Tensor]
"""(model, batch) -> per-token NLL [T] of the scored tokens."""


def run_interventions(
    model: torch.nn.Module, layer, batches: Mapping[str, Sequence[object]], nll_fn: NllFn,
    policies: Iterable[str] = POLICIES,
) -> List[PolicyResult]:
    """Baseline and each policy on every domain's batches; routing checked against baseline."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            base_nll, base_log = _evaluate(model, layer, batches, nll_fn, "identity")
            return [_policy_result(model, layer, batches, nll_fn, policy, base_nll, base_log)
                    for policy in policies]
    finally:
        model.train(was_training)


def _evaluate(model, layer, batches, nll_fn, policy):
    nll: Dict[str, Tuple[float, int]] = {}
    with override_mixing(layer, policy) as log:
        for domain, domain_batches in batches.items():
            total, count = 0.0, 0
            for batch in domain_batches:
                nll_T = nll_fn(model, batch).double()
                total, count = total + float(nll_T.sum()), count + nll_T.numel()
            if count == 0:
                raise ValueError(f"batches[{domain!r}]: no tokens. Fix: pass held-out batches")
            nll[domain] = (total / count, count)
    return nll, log


def _policy_result(model, layer, batches, nll_fn, policy, base_nll, base_log) -> PolicyResult:
    nll, log = _evaluate(model, layer, batches, nll_fn, policy)
    fixed, gate_diff = _compare_routing(base_log, log)
    domains = [DomainEffect(d, base_nll[d][0], nll[d][0], nll[d][1]) for d in batches]
    return PolicyResult(policy, domains, fixed, gate_diff)


def _compare_routing(base: RoutingLog, other: RoutingLog) -> Tuple[bool, float]:
    if len(base.calls) != len(other.calls):
        return False, float("inf")
    fixed, gate_diff = True, 0.0
    for (p0, m0), (p1, m1) in zip(base.calls, other.calls):
        fixed = fixed and torch.equal(m0, m1)
        gate_diff = max(gate_diff, float((p0 - p1).abs().max()) if p0.numel() else 0.0)
    return fixed, gate_diff
