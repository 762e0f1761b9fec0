"""Megatron's router trace (`--moe-routing-trace-path`) for MultiRouter too.

Megatron-Core 0.19.2's `RouterTracer.register_hooks` hooks `TopKRouter` modules only
(`router_trace.py:220`). MultiRouter produces the same `(probs, routing_map)` pair, has
`topk`, `layer_number`, `weight`, `expert_bias` and a `gating` that returns its per-head
logits, so the tracer's own hook function records it unchanged: the JSONL traces (one record
per step and layer, `top_indices` from the dispatched routing map) and Megatron-LM's
`tools/moe_routing` analyses work for every variant.

The hook is fed from a router observer, not a forward hook: the Multi-View layer calls
`router.route()` (it needs the per-head scores), which forward hooks never see; observers
run on every routing step, whichever entry point was used.
"""

from __future__ import annotations

from typing import List

from megatron.core.transformer.moe import router_trace
from megatron.core.utils import unwrap_model

from megatron_mvmoe.routing.router import MultiRouter


def start_router_trace(model_chunks: List, output_dir: str, max_iters: int, rank: int,
                       capture_logits: bool = False,
                       capture_hidden_states: bool = False) -> router_trace.RouterTracer:
    """Megatron's tracer in training mode, hooked on TopKRouter AND MultiRouter modules.
    The loop calls `tracer.advance_step(iteration)` after every optimizer step."""
    router_trace.init_moe_router_tracer(
        output_dir, max_iters, rank, training_mode=True,
        capture_hidden_states=capture_hidden_states, capture_logits=capture_logits)
    tracer = router_trace.get_moe_router_tracer()
    tracer.register_hooks(model_chunks)  # TopKRouter (latent / smoe / mh_moe baselines)
    register_multi_router_hooks(tracer, model_chunks)
    return tracer


class _TraceObserver:
    """A MultiRouter observer that hands each routing step to the tracer's hook function
    (which ignores calls once the tracer stopped at max_iters)."""

    def __init__(self, tracer: router_trace.RouterTracer, router: MultiRouter, name: str):
        self.router, self.hook = router, tracer.make_hook(name)

    def __call__(self, output) -> None:
        inputs = () if output.hidden_TD is None else (output.hidden_TD,)
        self.hook(self.router, inputs, (output.probs_TE, output.routing_map_TE))


def register_multi_router_hooks(tracer: router_trace.RouterTracer, model_chunks: List) -> int:
    """Trace every MultiRouter through an observer; returns how many were hooked."""
    hooked = 0
    for chunk in model_chunks:
        for name, module in unwrap_model(chunk).named_modules():
            if isinstance(module, MultiRouter):
                module.observers.append(_TraceObserver(tracer, module, name))
                hooked += 1
    return hooked
