"""The model variants of the small-scale reproductions of the seeds' comparisons, as run
configs for the training engineer's trainer.

Suites:
- `a` (seed 000, Tables 1/3-4 at toy scale): latent MoE baseline, Multi-Router (R = 2),
  Multi-View (R = K = 2) and Multi-View with stop-gradient on the mixing weights. All share
  the `tiny_*` backbone of models/presets.py (D = 64, L = 32, E = 4, top-2, 2 layers).
- `b` (seed 001, Tables 1, 2, 4, 5 at toy scale): dense, SMoE, fine-grained SMoE, MH-MoE
  h = 2 and h = 3, the shared-expert versions of SMoE and MH-MoE h = 2, and the head/merge
  ablations (SMoE + head/merge, MH-MoE h = 2 without head and merge, head only, merge only).
  Dimensions come from models/seed2_presets.py (the MH-MoE engineer's parity-matched
  recipes) at D = 48 and 2 layers (MoE every second layer, as the paper) so a run fits in
  about a minute on one CPU core; every ratio (F/D, E, k, H) of the recipe is kept.

Design choices:
- A variant is a dict of `ModelSection` fields; seed-2 fields that the ModelSection does not
  name (moe_layer_freq, pre-softmax gating, the MH-MoE switches) go through `extra`, which
  the provider passes to MVMoETransformerConfig unchanged, so the parity-matched shapes are
  exactly the preset's.
- Everything else of the run (data, steps, batch, LR) is shared by all variants of a suite.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

SUITE_A = ("latent", "multi_router", "multi_view", "multi_view_stopgrad")
SUITE_B = ("dense", "smoe", "fine_grained", "mh_moe_h2", "mh_moe_h3", "smoe_shared",
           "mh_moe_h2_shared", "smoe_head_merge", "mh_moe_h2_no_proj", "mh_moe_h2_head_only",
           "mh_moe_h2_merge_only")
SUITES = {"a": SUITE_A, "b": SUITE_B}

_SECTION_KEYS = {"moe_variant", "num_layers", "hidden_size", "num_attention_heads",
                 "ffn_hidden_size", "vocab_size", "seq_length"}
_MOE_KEYS = {"num_moe_experts": "num_experts", "moe_ffn_hidden_size": "moe_ffn_hidden_size",
             "moe_router_topk": "moe_router_topk",
             "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size"}
_PROVIDER_SETS = {"gated_linear_unit", "activation_func", "add_bias_linear", "normalization",
                  "bitnet", "moe_token_dispatcher_type", "moe_router_load_balancing_type",
                  "moe_aux_loss_coeff"}


@dataclass(frozen=True)
class Variant:
    name: str
    suite: str
    model: Dict[str, Any] = field(default_factory=dict)
    """ModelSection fields (with `extra`)."""
    note: str = ""
    reference: str = ""
    """Variant this one is compared with in the table ('' = it is the reference)."""


def suite_a_variant(name: str, seq_length: int) -> Variant:
    presets = {"latent": "tiny_latent", "multi_router": "tiny_multi_router",
               "multi_view": "tiny_multi_view", "multi_view_stopgrad": "tiny_multi_view"}
    if name not in presets:
        raise ValueError(f"variant: unknown suite-a variant {name!r}. Fix: use {SUITE_A}")
    model: Dict[str, Any] = {"preset": presets[name], "seq_length": seq_length}
    if name == "multi_view_stopgrad":
        from megatron_mvmoe.config import MultiViewConfig
        from megatron_mvmoe.models.presets import PRESETS

        p = PRESETS["tiny_multi_view"]
        model["extra"] = {"multi_view": MultiViewConfig(
            num_routers=p["num_routers"], num_views=p["num_views"],
            gamma_ramp_steps=p["gamma_ramp_steps"], stop_grad_mixing=True)}
    note = "stop-gradient from mixing weights to views" if name == "multi_view_stopgrad" else ""
    return Variant(name, "a", model, note, "" if name == "latent" else "latent")


def suite_b_variant(name: str, seq_length: int, hidden_size: int = 48,
                    num_layers: int = 2) -> Variant:
    from megatron_mvmoe.models.seed2_presets import get_preset

    if name not in SUITE_B:
        raise ValueError(f"variant: unknown suite-b variant {name!r}. Fix: use {SUITE_B}")
    preset = get_preset(name, size="tiny", hidden_size=hidden_size)
    kwargs = preset.config_kwargs(num_layers=num_layers)
    model: Dict[str, Any] = {"vocab_size": preset.model.vocab_size, "seq_length": seq_length,
                             "extra": {}}
    for key, value in kwargs.items():
        if key in _SECTION_KEYS:
            model[key] = value
        elif key in _MOE_KEYS:
            model[_MOE_KEYS[key]] = value
        elif key == "multi_head":
            model["num_heads_mh"] = value.num_heads
            model["extra"]["multi_head"] = value
        elif key not in _PROVIDER_SETS:
            model["extra"][key] = value
    if preset.reference in (None, name):
        note = "reference"
    else:
        note = "parity-matched" if preset.matched else "ablation, not FLOPs-matched"
    reference = "" if name == "smoe" else (
        "smoe" if preset.reference in (None, name) else preset.reference)
    return Variant(name, "b", model, f"{preset.paper_row}; {note}", reference)


def variants(suite: str, names: List[str] = None, seq_length: int = 64) -> List[Variant]:
    if suite not in SUITES:
        raise ValueError(f"suite: unknown {suite!r}. Fix: use one of {sorted(SUITES)}")
    build = suite_a_variant if suite == "a" else suite_b_variant
    return [build(name, seq_length) for name in (names or SUITES[suite])]
