"""The model variants of the small-scale reproductions of the seeds' comparisons, as run
configs for the project's trainer, and the orderings the papers report.

Suites:
- `a` (seed 000, Tables 1/3-4): latent MoE baseline, Multi-Router (R = 2), Multi-View
  (R = K = 2) and Multi-View with stop-gradient on the mixing weights, on the main job's
  `tiny_*` backbone (D = 64, L = 32, E = 4, top-2, 2 layers).
- `b` (seed 001, Tables 1, 2, 4, 5): dense, SMoE, fine-grained SMoE, MH-MoE h = 2 and
  h = 3, the shared-expert versions of SMoE and MH-MoE h = 2, and the head/merge ablations.
  Dimensions come from config/seed2_presets.py (parity-matched recipes) at
  `SUITE_B_HIDDEN` = 96 and 4 layers (MoE every second layer, as the paper): h = 3
  sub-tokens are 32 wide, as wide as suite a's latent space (the earlier D = 48 gave
  16-wide sub-tokens, where MH-MoE lost to SMoE).
- `t3` (seed 001, Table 3): dense, SMoE, fine-grained, MH-MoE h = 2 / h = 3 with BitNet
  b1.58 on every linear, suite b's dimensions.
- `c` (beyond the papers, seed 000's future work): Multi-View with R = K = 3 and 4, and
  Multi-View on fine-grained experts (twice the experts at half the width and twice the
  top-k: E = 8, F = 32, top-4) against a fine-grained latent baseline; latent and
  Multi-View R = 2 on the suite-a backbone as anchors.

Design choices:
- A variant is the run config's model mapping: a preset name plus fields (suites a, c), or
  a seed-2 preset's `model_fields()` (suites b, t3: the parity-matched shapes exactly; the
  MH-MoE switches nested in `multi_head`, pre-softmax gating and the MoE layer frequency,
  Megatron fields we do not model, in `extra`).
- Everything else of the run (data, steps, batch, LR) is shared by all variants of a suite;
  a variant's name + model dict identify its runs, so suites that share a variant (a and c:
  latent, multi_view) share its runs in the resumable run store.
- `ORDERINGS[suite]`: (better, worse, what the paper reports). tools/compare.py tests each
  with the paired per-seed difference of held-out perplexity; suite c lists the questions
  the papers leave open instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List

SUITE_A = ("latent", "multi_router", "multi_view", "multi_view_stopgrad")
SUITE_B = ("dense", "smoe", "fine_grained", "mh_moe_h2", "mh_moe_h3", "smoe_shared",
           "mh_moe_h2_shared", "smoe_head_merge", "mh_moe_h2_no_proj", "mh_moe_h2_head_only",
           "mh_moe_h2_merge_only")
SUITE_T3 = ("dense", "smoe", "fine_grained", "mh_moe_h2", "mh_moe_h3")
SUITE_C = ("latent", "multi_view", "multi_view_r3", "multi_view_r4", "latent_fine",
           "multi_view_fine")
SUITES = {"a": SUITE_A, "b": SUITE_B, "t3": SUITE_T3, "c": SUITE_C}
REFERENCES = {"a": "latent", "b": "smoe", "t3": "smoe", "c": "latent"}
SUITE_B_HIDDEN, SUITE_B_LAYERS = 96, 4

_T1 = "seed 001 Table 1 (RedPajama ppl, 100K steps)"
ORDERINGS = {
    "a": [("multi_router", "latent", "seed 000: loss 2.2505 vs 2.2562, mean 33.67 vs 33.07"),
          ("multi_view", "latent", "seed 000: loss 2.2488 vs 2.2562, mean 34.25 vs 33.07"),
          ("multi_view", "multi_router", "seed 000: loss 2.2488 vs 2.2505"),
          ("multi_view", "multi_view_stopgrad", "seed 000 Tables 3-4: stop-grad +0.0114 loss")],
    "b": [("mh_moe_h3", "mh_moe_h2", f"{_T1}: 10.51 vs 10.70"),
          ("mh_moe_h2", "fine_grained", f"{_T1}: 10.70 vs 10.74"),
          ("fine_grained", "smoe", f"{_T1}: 10.74 vs 10.90"),
          ("mh_moe_h3", "smoe", f"{_T1}: 10.51 vs 10.90"),
          ("smoe", "dense", f"{_T1}: 10.90 vs 12.13"),
          ("mh_moe_h2_shared", "smoe_shared", "seed 001 Table 2: MH-MoE below SMoE"),
          ("mh_moe_h2", "mh_moe_h2_no_proj", "seed 001 Table 4: 11.46 vs 11.71 (50K steps)"),
          ("mh_moe_h2", "mh_moe_h2_head_only", "seed 001 Table 5: 11.60 vs 11.74"),
          ("mh_moe_h2_head_only", "mh_moe_h2_merge_only", "seed 001 Table 5: 11.74 vs 11.84"),
          ("mh_moe_h2_merge_only", "mh_moe_h2_no_proj", "seed 001 Table 5: 11.84 vs 11.97"),
          ("mh_moe_h2", "smoe_head_merge", "seed 001 Table 4: 11.46 vs 11.84")],
    "t3": [("mh_moe_h3", "smoe", "seed 001 Table 3 (BitNet): 26.47 vs 26.78"),
           ("mh_moe_h3", "fine_grained", "seed 001 Table 3 (BitNet): 26.47 vs 26.68"),
           ("fine_grained", "smoe", "seed 001 Table 3 (BitNet): 26.68 vs 26.78"),
           ("smoe", "dense", "seed 001 Table 3 (BitNet): 26.78 vs 30.04")],
    "c": [("multi_view_r3", "multi_view", "open (seed 000 future work: R = K > 2)"),
          ("multi_view_r4", "multi_view", "open (seed 000 future work: R = K > 2)"),
          ("multi_view_r3", "latent", "open"),
          ("multi_view_r4", "latent", "open"),
          ("multi_view_fine", "latent_fine",
           "open (seed 000 future work: fine-grained experts)")],
}
"""suite -> [(expected better, expected worse, the paper's evidence)]."""

@dataclass(frozen=True)
class Variant:
    name: str
    suite: str
    model: Dict[str, Any] = field(default_factory=dict)
    """The run config's model mapping (ModelSection fields, our configs nested)."""
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
        model["multi_view"] = {"stop_grad_mixing": True}
    note = "stop-gradient from mixing weights to views" if name == "multi_view_stopgrad" else ""
    return Variant(name, "a", model, note, "" if name == "latent" else "latent")


_FINE = dict(num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=4)
"""Fine-grained version of the tiny latent backbone: 2 x experts, 1/2 width, 2 x top-k."""


def suite_c_variant(name: str, seq_length: int) -> Variant:
    if name not in SUITE_C:
        raise ValueError(f"variant: unknown suite-c variant {name!r}. Fix: use {SUITE_C}")
    if name in ("latent", "multi_view"):
        return dataclasses.replace(suite_a_variant(name, seq_length), suite="c")
    model: Dict[str, Any] = {"seq_length": seq_length}
    if name.startswith("multi_view_r"):
        heads = int(name[-1])
        model.update(preset="tiny_multi_view",
                     multi_view={"num_routers": heads, "num_views": heads})
        return Variant(name, "c", model, f"R = K = {heads}", "multi_view")
    fine = name.endswith("_fine")
    model.update(preset="tiny_multi_view" if name.startswith("multi_view") else "tiny_latent",
                 **(_FINE if fine else {}))
    note = "fine-grained: E = 8, F = 32, top-4 (2 x E, 1/2 width, 2 x k)"
    return Variant(name, "c", model, note, "" if name == "latent_fine" else "latent_fine")


def suite_b_variant(name: str, seq_length: int, hidden_size: int = SUITE_B_HIDDEN,
                    num_layers: int = SUITE_B_LAYERS, bitnet: bool = False) -> Variant:
    from megatron_mvmoe.config.seed2_presets import get_preset

    if name not in SUITE_B:
        raise ValueError(f"variant: unknown suite-b variant {name!r}. Fix: use {SUITE_B}")
    preset = get_preset(name, size="tiny", hidden_size=hidden_size, bitnet=bitnet)
    model = preset.model_fields(num_layers=num_layers, seq_length=seq_length)
    if preset.reference in (None, name):
        note = "reference"
    else:
        note = "parity-matched" if preset.matched else "ablation, not FLOPs-matched"
    reference = "" if name == "smoe" else (
        "smoe" if preset.reference in (None, name) else preset.reference)
    return Variant(name, "t3" if bitnet else "b", model, f"{preset.paper_row}; {note}",
                   reference)


def variants(suite: str, names: List[str] = None, seq_length: int = 128) -> List[Variant]:
    if suite not in SUITES:
        raise ValueError(f"suite: unknown {suite!r}. Fix: use one of {sorted(SUITES)}")
    unknown = [n for n in (names or []) if n not in SUITES[suite]]
    if unknown:
        raise ValueError(f"--variants: {unknown} not in suite {suite}. Fix: use some of "
                         f"{SUITES[suite]}")
    build = {"a": suite_a_variant, "b": suite_b_variant, "c": suite_c_variant,
             "t3": lambda name, seq: suite_b_variant(name, seq, bitnet=True)}[suite]
    return [build(name, seq_length) for name in (names or SUITES[suite])]
