"""The seed-2 (MH-MoE paper, seed 001) model family as presets, paper size and tiny CPU size.

Design choices:
- A preset is a frozen `Seed2Preset`: the dimensions that matter for parity (a
  `parity.MoELayerShape` plus backbone sizes) and `model_fields()`, the run config's model
  mapping (the one preset format, as config/presets.py's);
  `models.provider.fields_config(preset.model_fields())` builds its `MVMoETransformerConfig`
  as the trainer does. The parity numbers and the config come from the same fields, so the
  tool's table and a training run cannot disagree.
- Paper size: 12 layers, D = 768, SwiGLU everywhere, every second FFN an MoE layer
  (Megatron's `moe_layer_freq=2`: layers 1, 3, 5, ... counted from 1), dense FFN 2048.
  SMoE 8 x 2048 top-1; fine-grained 16 x 1024 top-2 (see below); MH-MoE H=2: 40 x 768 top-2; H=3:
  96 x 512 top-3 (experts see D/H). `_shared` adds a shared expert of 2048 on the full token.
- Fine-grained SMoE is 16 x 1024 with TOP-2. The summary says "top-1 gating is preserved",
  but 16 x 1024 top-1 has half the SMoE's expert FLOPs, contradicting the paper's "matched in
  parameters and computation"; top-2 (the usual fine-grained recipe: halve the width, double
  E and k) is the matched reading. `fine_grained_top1` keeps the literal reading, unmatched.
- Ablations (Tables 4-5): SMoE / fine-grained with head + merge but no split (deliberately
  NOT FLOPs-matched: +25 % / +25 % leading term), MH-MoE H=2 without head and merge, head
  only, merge only (deliberately below the budget).
- Tiny size keeps every ratio (F/D, E, k, H) and scales D: D = 96 (must be a multiple of 6
  so that 8D/3, D/2, 2D/3 are integers), 4 layers, 4 attention heads, vocab 4096.
- Gating: softmax over all experts, then top-k (`moe_router_pre_softmax=True`; Megatron
  refuses top-1 otherwise, whose post-top-k softmax has zero gradient), aux-loss balancing
  with coefficient 1e-2 (the paper gives neither; same for every preset).
- The paper does not state vocab, sequence length or attention heads: we use 12 heads,
  GPT-2 BPE padded to 50304 and 1024 tokens (only whole-model totals depend on them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_mvmoe.functional.parity import MoELayerShape
from megatron_mvmoe.functional.parity_model import ParityModelDims

SIZES = {
    # hidden, layers, attention heads, vocab, seq length
    "paper": dict(hidden_size=768, num_layers=12, num_attention_heads=12,
                  vocab_size=50304, seq_length=1024),
    "tiny": dict(hidden_size=96, num_layers=4, num_attention_heads=4,
                 vocab_size=4096, seq_length=128),
}

# name -> (family, reference, matched, paper row, MoE recipe in units of D or None)
# recipe: (experts, ffn as a fraction of D, top-k, heads, head proj, merge proj, split)
_RECIPES = {
    "dense": ("dense", None, False, "Table 1 Dense", None),
    "smoe": ("smoe", "smoe", True, "Table 1 SMoE", (8, 8 / 3, 1, 1, False, False, True)),
    "fine_grained": ("smoe", "smoe", True, "Table 1 Fine-grained SMoE",
                     (16, 4 / 3, 2, 1, False, False, True)),
    "fine_grained_top1": ("smoe", "smoe", False, "Fine-grained as the summary words it (top-1)",
                          (16, 4 / 3, 1, 1, False, False, True)),
    "mh_moe_h2": ("mh_moe", "smoe", True, "Table 1 MH-MoE (head=2)",
                  (40, 1, 2, 2, True, True, True)),
    "mh_moe_h3": ("mh_moe", "smoe", True, "Table 1 MH-MoE (head=3)",
                  (96, 2 / 3, 3, 3, True, True, True)),
    "smoe_head_merge": ("mh_moe", "smoe", False, "Table 4 SMoE w/ head+merge",
                        (8, 8 / 3, 1, 1, True, True, False)),
    "fine_grained_head_merge": ("mh_moe", "smoe", False, "Table 4 Fine-grained w/ head+merge",
                                (16, 4 / 3, 2, 1, True, True, False)),
    "mh_moe_h2_no_proj": ("mh_moe", "smoe", False, "Table 4/5 MH-MoE w/o head, w/o merge",
                          (40, 1, 2, 2, False, False, True)),
    "mh_moe_h2_head_only": ("mh_moe", "smoe", False, "Table 5 head only",
                            (40, 1, 2, 2, True, False, True)),
    "mh_moe_h2_merge_only": ("mh_moe", "smoe", False, "Table 5 merge only",
                             (40, 1, 2, 2, False, True, True)),
}
SHARED_FFN_OVER_D = 8 / 3
"""Shared expert width 2048 at D = 768 (Table 2), kept as a ratio for the tiny size."""

DENSE_FFN_OVER_D = 8 / 3
"""Dense SwiGLU FFN width 2048 at D = 768 (the paper's dense baseline is not specified
further; we take the SMoE expert width)."""

SHAREABLE = ("smoe", "fine_grained", "mh_moe_h2", "mh_moe_h3")


def _scaled(hidden_size: int, ratio: float, what: str) -> int:
    value = hidden_size * ratio
    if abs(value - round(value)) > 1e-9:
        raise ValueError(f"hidden_size: {hidden_size} x {ratio:.4f} ({what}) is not an integer. "
                         "Fix: use a hidden_size that is a multiple of 6")
    return int(round(value))


@dataclass(frozen=True)
class Seed2Preset:
    """One model of the seed-2 family."""

    name: str
    """Preset name, e.g. mh_moe_h3_shared."""
    family: str
    """moe_variant of the config: dense, smoe or mh_moe."""
    reference: Optional[str]
    """Preset whose costs this one is compared to (the SMoE of the same shared setting)."""
    matched: bool
    """True when the paper claims FLOPs and parameter parity with the reference."""
    paper_row: str
    """Where the paper reports it."""
    model: ParityModelDims
    """Dimensions used for the parity numbers and the config."""
    num_attention_heads: int
    """Attention heads."""
    bitnet: bool = False
    """BitNet b1.58 quantization-aware training of all linear layers (Table 3)."""

    def model_fields(self, **overrides) -> dict:
        """The preset as a run config's model mapping (ModelSection fields, our configs
        nested; overrides win). Routing is the provider's SMoE default (softmax top-k,
        aux loss 1e-2, alltoall); pre-softmax gating and the MoE layer frequency are
        Megatron fields we do not model, so they travel in `extra`."""
        m = self.model
        fields = dict(moe_variant=self.family, num_layers=m.num_layers,
                      hidden_size=m.hidden_size, num_attention_heads=self.num_attention_heads,
                      ffn_hidden_size=m.dense_ffn, vocab_size=m.vocab_size,
                      seq_length=m.seq_length, extra={})
        if self.bitnet:
            fields["bitnet"] = {"enabled": True}
        if m.moe is not None:
            moe = m.moe
            fields.update(num_experts=moe.num_experts, moe_ffn_hidden_size=moe.expert_ffn,
                          moe_router_topk=moe.topk,
                          moe_shared_expert_intermediate_size=moe.shared_expert_ffn or None,
                          extra={"moe_layer_freq": m.moe_layer_freq,
                                 "moe_router_pre_softmax": True})
        if self.family == "mh_moe":
            fields["multi_head"] = dict(
                num_heads=m.moe.num_heads, head_projection=m.moe.head_projection,
                merge_projection=m.moe.merge_projection, split_tokens=m.moe.split_tokens)
        fields.update(overrides)
        return fields


def _moe_shape(recipe: tuple, hidden_size: int, shared: bool) -> MoELayerShape:
    experts, ffn_ratio, topk, heads, head, merge, split = recipe
    return MoELayerShape(
        hidden_size=hidden_size, num_experts=experts,
        expert_ffn=_scaled(hidden_size, ffn_ratio, "expert ffn"),
        topk=topk, num_heads=heads, head_projection=head, merge_projection=merge,
        split_tokens=split,
        shared_expert_ffn=_scaled(hidden_size, SHARED_FFN_OVER_D, "shared ffn") if shared else 0)


def family_names() -> list[str]:
    """The family's model names: the recipes plus `_shared` variants of the Table 2 models
    (registered in config/presets.py as seed2_<name> and seed2_tiny_<name>)."""
    return list(_RECIPES) + [f"{name}_shared" for name in SHAREABLE]


def get_preset(name: str, size: str = "paper", bitnet: bool = False,
               hidden_size: Optional[int] = None) -> Seed2Preset:
    """Build a preset. size: 'paper' (D=768, 12 layers) or 'tiny' (D=96, 4 layers);
    hidden_size overrides D (a multiple of 6) keeping every ratio."""
    if size not in SIZES:
        raise ValueError(f"size: unknown size {size!r}. Fix: use one of {sorted(SIZES)}")
    shared = name.endswith("_shared")
    base_name = name[: -len("_shared")] if shared else name
    if base_name not in _RECIPES or (shared and base_name not in SHAREABLE):
        raise ValueError(f"name: unknown preset {name!r}. Fix: use one of {family_names()}")
    family, reference, matched, paper_row, recipe = _RECIPES[base_name]
    dims = dict(SIZES[size])
    if hidden_size is not None:
        dims["hidden_size"] = hidden_size
    d = dims["hidden_size"]
    moe = None if recipe is None else _moe_shape(recipe, d, shared)
    model = ParityModelDims(num_layers=dims["num_layers"], hidden_size=d,
                       vocab_size=dims["vocab_size"], seq_length=dims["seq_length"],
                       dense_ffn=_scaled(d, DENSE_FFN_OVER_D, "dense ffn"), moe=moe)
    if reference is not None and shared:
        reference = f"{reference}_shared"
    if shared:
        paper_row = paper_row.replace("Table 1", "Table 2")
    if bitnet:
        paper_row = paper_row.replace("Table 1", "Table 3")
    return Seed2Preset(name=name, family=family, reference=reference, matched=matched,
                       paper_row=paper_row, model=model,
                       num_attention_heads=dims["num_attention_heads"], bitnet=bitnet)


def all_presets(size: str = "paper", bitnet: bool = False) -> list[Seed2Preset]:
    """Every preset of one size."""
    return [get_preset(name, size, bitnet) for name in family_names()]
