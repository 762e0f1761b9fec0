"""Read-only probes into Megatron MoE layers: captured inputs, routing, dense expert outputs,
and the "toggle one expert" output delta used by the loss-change utility.

Legend: T tokens (flattened [S, B] order, as inside MoELayer), D hidden size, L the experts'
width (latent size for latent layers, D for stock SMoE), E experts, S selected slots,
R routing heads.

Design choices:
- Works from OUTSIDE the layers (forward hooks, public attributes), for Megatron's stock
  MoELayer + TopKRouter, LatentMoELayer and MultiViewMoELayer (with MultiRouter): one code
  path per "what does expert i receive", chosen by the layer's type.
- Routing is recomputed from the captured layer input with the layer's own router under
  no_grad (nothing is counted, no side effect on the layer's pending state); for the
  MultiRouter it is `route()`, so scores, selection, gates and mixing weights are exactly
  what the layer's forward uses.
- Dense evaluation runs the layer's own experts module on every (token, expert) pair, with
  tokens_per_expert = [T] * E and probs = 1, so E_i(x_i) is the layer's real expert; this
  needs every expert local (EP = 1), otherwise a ValueError says so.
- For Multi-View, expert i receives sum_m a_{m,i} v_m with a_{m,i} from Eq. 4 evaluated for
  EVERY expert (Eq. 4 is defined per expert, selected or not); a selected expert's row is
  then exactly the row the layer dispatches.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch
from megatron.core.transformer.moe.moe_layer import MoELayer

from megatron_mvmoe.analysis.routing.alignment import forced_gates, toggle_signs
from megatron_mvmoe.views import mix_views, mixing_weights
from megatron_mvmoe.views.protocols import ViewMixing


@dataclass
class RoutingProbe:
    """Routing of one MoE layer for a batch of tokens."""

    scores_TRE: torch.Tensor
    """Per-head sigmoid (or softmax) scores [T, R, E]; R = 1 for a single router."""
    summed_TE: torch.Tensor
    """Unbiased router score s_bar [T, E] (what alignment ranks)."""
    topk_idx_TS: torch.Tensor
    """Selected experts [T, S], ascending per row."""
    gates_TS: torch.Tensor
    """Output gates of the selected experts [T, S]."""
    routing_map_TE: torch.Tensor
    """Bool selection map [T, E]."""
    mix_TSR: Optional[torch.Tensor]
    """Mixing weights of the selected slots [T, S, R] (None without view mixing)."""
    alpha: Union[float, torch.Tensor]
    """Gate scale alpha (scalar or per expert)."""
    num_routers: int
    """R."""
    normalizer_eps: float
    """Floor of Eq. 3's normaliser the router uses (MultiRouter: multi_view.normalizer_eps;
    Megatron's TopKRouter adds 1e-20)."""


def moe_layers(model: torch.nn.Module) -> Dict[int, MoELayer]:
    """MoE layers of a model keyed by their Megatron layer_number (1-based), else by order."""
    found = [m for m in model.modules() if isinstance(m, MoELayer)]
    if not found:
        raise ValueError("model: no Megatron MoELayer found. Fix: pass an MoE model "
                         "(moe_variant other than 'dense')")
    keys = [getattr(m, "layer_number", None) for m in found]
    if None in keys or len(set(keys)) != len(keys):
        keys = list(range(1, len(found) + 1))
    return dict(zip(keys, found))


@contextlib.contextmanager
def capture_inputs(layers: Dict[int, MoELayer]) -> Iterator[Dict[int, torch.Tensor]]:
    """Records the hidden states [S, B, D] each layer receives during the forwards run inside."""
    captured: Dict[int, torch.Tensor] = {}
    handles = [layer.register_forward_pre_hook(_recorder(captured, key))
               for key, layer in layers.items()]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def _recorder(captured, key):
    def hook(module, args, kwargs=None):
        captured[key] = args[0].detach()
    return hook


def _flat(hidden: torch.Tensor) -> torch.Tensor:
    return hidden.reshape(-1, hidden.shape[-1])


@torch.no_grad()
def probe_routing(layer: MoELayer, hidden: torch.Tensor) -> RoutingProbe:
    """Recompute the layer's routing for `hidden` [S, B, D] (or [T, D])."""
    router = layer.router
    if hasattr(router, "route"):
        out = router.route(hidden)
        scale = router.gate_scale
        alpha = scale.detach() if isinstance(scale, torch.Tensor) else float(scale)
        return RoutingProbe(out.scores_TRE, out.scores_TRE.sum(dim=1), out.topk_idx_TS,
                            out.gates_TS, out.routing_map_TE, out.mix_TSR, alpha,
                            router.num_routers, router.config.multi_view.normalizer_eps)
    probs_TE, routing_map_TE = router(hidden)
    logits_TE = torch.nn.functional.linear(_flat(hidden).float(), router.weight.float())
    if layer.config.moe_router_score_function == "sigmoid":
        scores_TE = torch.sigmoid(logits_TE)
    else:
        scores_TE = torch.softmax(logits_TE, dim=-1)
    topk_idx_TS = _slots(routing_map_TE, layer.config.moe_router_topk)
    alpha = layer.config.moe_router_topk_scaling_factor or 1.0
    return RoutingProbe(scores_TE.unsqueeze(1), scores_TE, topk_idx_TS,
                        probs_TE.gather(1, topk_idx_TS), routing_map_TE, None, alpha, 1,
                        _MEGATRON_GATE_EPS)


_MEGATRON_GATE_EPS = 1e-20  # TopKRouter: scores / (sum of selected + 1e-20)


@torch.no_grad()
def probe_batches(model: torch.nn.Module, layers: Dict[int, MoELayer],
                  by_domain: Mapping[str, Sequence[object]],
                  forward: Callable[[torch.nn.Module, object], object]
                  ) -> Dict[int, List[RoutingProbe]]:
    """layer -> one RoutingProbe per batch: `forward(model, batch)` runs every batch (domains
    in sorted order) while the layers' inputs are captured, then each layer is probed."""
    probes: Dict[int, List[RoutingProbe]] = {key: [] for key in layers}
    for domain in sorted(by_domain):
        for batch in by_domain[domain]:
            with capture_inputs(layers) as inputs:
                forward(model, batch)
            for key, layer in layers.items():
                probes[key].append(probe_routing(layer, inputs[key]))
    return probes


def _slots(routing_map_TE: torch.Tensor, k: int) -> torch.Tensor:
    """[T, E] bool with k Trues per row -> ascending expert ids [T, k]."""
    num_experts = routing_map_TE.shape[1]
    ids_TE = torch.arange(num_experts).expand_as(routing_map_TE)
    keyed_TE = torch.where(routing_map_TE, ids_TE, ids_TE + num_experts)
    return keyed_TE.sort(dim=1).values[:, :k]


@torch.no_grad()
def expert_inputs(layer: MoELayer, hidden: torch.Tensor, probe: RoutingProbe) -> torch.Tensor:
    """What every expert would receive for every token: [T, E, L]."""
    from megatron_mvmoe.layers.latent_moe import LatentMoELayer
    hidden_TD = _flat(hidden)
    num_experts = layer.config.num_moe_experts
    if isinstance(layer, ViewMixing):
        views_TRL = layer.views_of(hidden_TD)
        if views_TRL.shape[1] == 1:
            return views_TRL.expand(-1, num_experts, -1)
        all_TE = torch.arange(num_experts).expand(hidden_TD.shape[0], num_experts)
        return mix_views(views_TRL, mixing_weights(probe.scores_TRE, all_TE))
    if isinstance(layer, LatentMoELayer):
        return layer.fc1_latent_proj(hidden_TD).unsqueeze(1).expand(-1, num_experts, -1)
    return hidden_TD.unsqueeze(1).expand(-1, num_experts, -1)


@torch.no_grad()
def dense_expert_outputs(layer: MoELayer, inputs_TEL: torch.Tensor) -> torch.Tensor:
    """E_i(x_i) for every token and expert with the layer's own experts: [T, E, L]."""
    num_tokens, num_experts, width = inputs_TEL.shape
    if layer.num_local_experts != num_experts:
        raise ValueError(
            f"dense evaluation needs all {num_experts} experts on this rank, it holds "
            f"{layer.num_local_experts}. Fix: load the model with expert_model_parallel_size=1")
    rows_NL = inputs_TEL.transpose(0, 1).reshape(num_experts * num_tokens, width).contiguous()
    tokens_per_expert = torch.full((num_experts,), num_tokens, dtype=torch.int64)
    probs_N = torch.ones(rows_NL.shape[0], dtype=rows_NL.dtype, device=rows_NL.device)
    out_NL, _ = layer.experts(rows_NL, tokens_per_expert, probs_N)
    return out_NL.view(num_experts, num_tokens, -1).transpose(0, 1)


def up_projection(layer: MoELayer) -> Callable[[torch.Tensor], torch.Tensor]:
    """Maps the experts' combined width back to D (identity for stock SMoE)."""
    proj = getattr(layer, "fc2_latent_proj", None)
    if proj is None:
        return lambda x: x
    return lambda x: _first(proj(x))


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def toggle_delta(layer: MoELayer, probe: RoutingProbe, outputs_TEL: torch.Tensor,
                 expert: int) -> torch.Tensor:
    """Change of the layer output [T, D] when `expert` is removed (if selected) or added
    (if not) for every token, other slots and gates unchanged."""
    num_experts = outputs_TEL.shape[1]
    gates_TE = forced_gates(probe.summed_TE, probe.topk_idx_TS, probe.alpha, probe.num_routers,
                            probe.normalizer_eps)
    signs_TE = toggle_signs(probe.topk_idx_TS, num_experts)
    weight_T1 = (signs_TE[:, expert] * gates_TE[:, expert]).unsqueeze(1)
    return up_projection(layer)(weight_T1.to(outputs_TEL.dtype) * outputs_TEL[:, expert])


@contextlib.contextmanager
def add_to_output(layer: MoELayer, delta_TD: torch.Tensor) -> Iterator[None]:
    """Adds delta [T, D] to the layer's output during the forwards run inside."""
    def hook(module, args, output):
        out, bias = output
        return out + delta_TD.view_as(out).to(out.dtype), bias

    handle = layer.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
