"""The dispatcher registry's builders: config.moe_dispatcher -> the token dispatcher every MoE
layer of a model runs (config/dispatchers.py holds the records: names, variants, refusals).

Design choices:
- "alltoall" is what the layers build themselves (Megatron's MoEAlltoAllTokenDispatcher, the
  Multi-View layer's PerRowAlltoAllTokenDispatcher), so installing it changes nothing and
  every golden loss stays bit-identical.
- The dedup dispatchers replace a layer's alltoall dispatcher right after the model is built
  (models/build.py), with the same groups, experts and config: they hold no parameters, so
  the seeded init is the same and checkpoints do not depend on the dispatcher.
- A layer that mixes views calls the one per-row contract both dispatchers implement
  (layers/per_row_dispatcher.py `PerRowDispatch.dispatch_preprocess_views`); each decides
  what crosses (`multi_view_input`: "rows" = one blended row per (token, expert), "views" =
  the K views + weights, blended on arrival).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Dict, Optional

import torch
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from megatron_mvmoe.config.dispatchers import DEFAULT_DISPATCHER, check_dispatcher
from megatron_mvmoe.layers.dedup_dispatcher import DedupAlltoAllTokenDispatcher

Builder = Callable[[MoEAlltoAllTokenDispatcher, object, Optional[int]],
                   MoEAlltoAllTokenDispatcher]


def _keep(old, config, ranks_per_node):
    return old


def _dedup(semantics: str) -> Builder:
    def build(old, config, ranks_per_node):
        return DedupAlltoAllTokenDispatcher(
            old.num_local_experts, old.local_expert_indices, config, _groups_of(old),
            semantics=semantics, ranks_per_node=ranks_per_node)
    return build


BUILDERS: Dict[str, Builder] = {
    "alltoall": _keep,
    "dedup_rank": _dedup("rank"),
    "dedup_node": _dedup("node"),
}
"""One builder per record of config.dispatchers.DISPATCHERS (same keys, tested): the dispatcher
that replaces a layer's alltoall dispatcher `old`."""


def install_dispatchers(model: torch.nn.Module, config) -> int:
    """Give every alltoall-dispatched MoE layer of `model` the dispatcher `config` selects
    (config.moe_dispatcher, refused pairs raising one error). Returns the layers changed."""
    if config.moe_dispatcher == DEFAULT_DISPATCHER:
        return 0
    build = BUILDERS[check_dispatcher(config).name]
    changed = 0
    for module in model.modules():
        old = getattr(module, "token_dispatcher", None)
        if not isinstance(old, MoEAlltoAllTokenDispatcher) or isinstance(
                old, DedupAlltoAllTokenDispatcher):
            continue
        module.token_dispatcher = build(old, old.config, config.moe_dispatch_ranks_per_node)
        changed += 1
    return changed


def _groups_of(dispatcher):
    """The process groups a dispatcher was built with, as a pg_collection."""
    return SimpleNamespace(ep=dispatcher.ep_group, expt_tp=dispatcher.tp_group,
                           tp_ep=dispatcher.tp_ep_group)
