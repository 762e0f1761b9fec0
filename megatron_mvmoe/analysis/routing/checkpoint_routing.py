"""A trained checkpoint's real routing on held-out text: per-layer routing maps and the
load profile the scale model draws from (`checkpoint_routing`, `load_profile`).

Design choices:
- The model is opened by the tools' front door (`toolkit/specs.open_spec`: the run's own
  `models.build.build_model` and `checkpointing.weights.load_weights`), routed on the
  run's held-out batches (real text when the run has a data path) and probed with
  `moe_probe.probe_routing`, i.e. with the layer's own router (MultiRouter's `route()` for
  Multi-View).
- `load_profile` averages the layers' SORTED per-expert shares: a load shape independent
  of which expert id is hot, which is what a model with another expert count can borrow.
"""

from __future__ import annotations

from typing import Dict, List

import torch


def _rank(rank, world_size, checkpoint: str, batches: int, batch_size: int, seed: int):
    from megatron_mvmoe.analysis.routing import probe as moe_probe
    from megatron_mvmoe.toolkit import heldout, specs

    spec = specs.parse_model_spec(checkpoint)
    opened = specs.open_spec(spec, specs.in_rank_setup())
    layers = moe_probe.moe_layers(opened.model)
    by_domain = heldout.heldout_batches(opened.run, batches, batch_size, seed)
    probes = moe_probe.probe_batches(opened.model, layers, by_domain,
                                     heldout.gpt_token_nll)
    config = opened.config
    return {"source": opened.source, "variant": config.moe_variant,
            "data": heldout.SYNTHETIC if "random" in by_domain else sorted(by_domain),
            "hidden": config.hidden_size, "latent": config.latent_size,
            "views": config.multi_view.num_views,
            "maps": {str(k): torch.cat([p.routing_map_TE for p in chunks])
                     for k, chunks in probes.items()}}


def checkpoint_routing(checkpoint: str, batches: int = 4, batch_size: int = 2,
                       seed: int = 0) -> dict:
    """{source, variant, data, hidden, latent, views, maps: {layer: bool [T, E]}}."""
    from megatron_mvmoe.toolkit import specs

    return specs.single_rank(_rank, checkpoint, batches, batch_size, seed)


def load_profile(maps_by_layer: Dict[str, torch.Tensor]) -> List[float]:
    """Mean over layers of the sorted (descending) per-expert shares of assignments."""
    profiles = []
    for map_TE in maps_by_layer.values():
        load_E = map_TE.long().sum(0).double()
        profiles.append(torch.sort(load_E / load_E.sum(), descending=True).values)
    return torch.stack(profiles).mean(0).tolist()
