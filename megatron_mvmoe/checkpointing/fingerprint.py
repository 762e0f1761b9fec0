"""The model fingerprint: the fields that change a parameter's shape or meaning, stored in
run_state.json at save and compared before any tensor is read, so loading into another
model fails naming the differing fields instead of deep inside dist-checkpointing.

Design choices:
- ONE function, `model_fingerprint(model)`, computes it (the trainer's save and resume,
  the tools' `load_weights`) from the resolved model section.
- An allow-list (`STRUCTURAL`): a field is compared only once it is listed here, so a new
  field that holds no parameters (the dispatcher was one) never refuses older checkpoints.
  `NOT_STRUCTURAL` lists the rest; a test keeps the two covering every ModelSection field.
- What is written keeps the keys every earlier version wrote (the flat R, K, H; the
  dispatcher fields since ecf52e9), so older code still reads a new checkpoint; what is
  compared is only the allow-list, so a checkpoint that recorded more (or fewer) fields
  loads. A structural field a checkpoint predates takes its old value (`ADDED_LATER`).
- Fields outside the allow-list may change on resume; `changed_on_resume` names them for
  the one line the trainer prints.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List

from megatron_mvmoe.checkpointing.errors import CheckpointError
from megatron_mvmoe.config.model_section import (ARCHITECTURE_FIELDS, FUSION_SWITCHES,
                                                 ModelSection, position_table_rows)
from megatron_mvmoe.config.transformer_config import MultiHeadConfig

if TYPE_CHECKING:
    from megatron_mvmoe.config.run_config import RunConfig

SHAPE_FIELDS = ("moe_variant", "num_layers", "hidden_size", "num_attention_heads",
                "num_query_groups", "ffn_hidden_size", "num_experts", "moe_ffn_hidden_size",
                "moe_router_topk", "moe_shared_expert_intermediate_size", "latent_size",
                "vocab_size", "rotary_base", *ARCHITECTURE_FIELDS, "extra")
"""ModelSection fields recorded and compared as they are (RoPE's base changes what the
attention weights compute, the architecture switches which weights exist and what they
compute; `extra` holds Megatron fields we do not model, compared but for
EXTRA_NOT_STRUCTURAL, because some of them shape parameters)."""

EXTRA_NOT_STRUCTURAL = (
    "attention_dropout", "hidden_dropout", "moe_aux_loss_coeff", "moe_z_loss_coeff",
    "moe_router_load_balancing_type", "moe_token_dispatcher_type",
    "moe_expert_capacity_factor", "moe_pad_expert_input_to_capacity", "moe_token_drop_policy",
    "moe_router_bias_update_rate", "recompute_granularity", "recompute_method",
    "recompute_num_layers", "recompute_modules", "moe_layer_recompute",
    "mtp_loss_scaling_factor", "init_method_std", "moe_router_dtype",
    "attention_softmax_in_fp32")
"""`extra` (Megatron TransformerConfig) fields that may change on resume: regularisation,
loss weights, balancing and dispatch, capacity and dropping, recomputation, initialisation
and math precision act on training, not on what a weight means. Every other `extra` key is
compared (it may shape parameters: MLA ranks, QK norm, MTP layers, the MoE layer pattern)."""

STRUCTURAL = SHAPE_FIELDS + ("num_routers", "num_views", "num_heads_mh",
                             "learned_gate_scale", "bitnet", "multi_head", "position_table_rows")
"""Every compared fingerprint key: the shape fields, then the nested sections' structural
switches in the flat form of the first checkpoints (R, K, H; learned alpha, BitNet and the
MH-MoE projections recorded only when not the default), and a learned position table's rows
when --max-position-embeddings makes them other than the sequence length (every learned
table before it had seq_length rows, RoPE none)."""

NOT_STRUCTURAL = ("preset", "moe_dispatcher", "moe_dispatch_ranks_per_node", "seq_length",
                  "max_position_embeddings", "multi_view", "attention_backend",
                  *FUSION_SWITCHES)
"""ModelSection fields not compared as they are: the recorded preset name, the token
dispatcher and its node size (they hold no parameters), the attention backend (SDPA and
Megatron's DotProductAttention compute one function of the same weights) and Megatron-LM's
fusion switches (a fused kernel computes the unfused one's function), the sequence
length and the position-table size (RoPE is computed, not stored; a learned table's rows
enter as `position_table_rows`) and multi_view (only R, K and learned alpha enter, flat; its
gamma ramp, gate scale, kernels, init std do not). bitnet's activation bits and input norm are
not compared either (`bitnet` above records only whether it is on)."""

RECORDED_NOT_COMPARED = ("moe_dispatcher", "moe_dispatch_ranks_per_node")
"""Written since ecf52e9 (older code reading a new checkpoint expects them), never compared."""

ADDED_LATER = {"rotary_base": 10000, **{name: ModelSection.__dataclass_fields__[name].default
                                        for name in ARCHITECTURE_FIELDS}}
"""Structural fields newer than the first checkpoints -> the value every model had before
they were recorded (a checkpoint without the field was built with it: 0.16.1's had no
rotary_base; none before issue 36 had the architecture switches, all SwiGLU, RMSNorm, RoPE,
untied, bias-free). The one table; tests/checkpointing/test_fingerprint_history.py checks it
against a stored run_state.json of each on-disk format."""


def model_fingerprint(model: ModelSection) -> Dict:
    """What run_state.json records: the STRUCTURAL keys in the flat form checkpoints have
    recorded since the first version (R, K and H flat; switches added later only when they
    differ from the default: learned alpha adds parameters, BitNet changes what weights
    mean, MH-MoE's projection switches change which weights exist), plus
    RECORDED_NOT_COMPARED."""
    fields = {name: getattr(model, name) for name in SHAPE_FIELDS + RECORDED_NOT_COMPARED}
    views, heads = model.multi_view, model.multi_head
    fields.update(num_routers=views.num_routers, num_views=views.num_views,
                  num_heads_mh=heads.num_heads, extra=dict(model.extra))
    if views.learned_gate_scale:
        fields["learned_gate_scale"] = True
    if model.bitnet.enabled:
        fields["bitnet"] = True
    if dataclasses.replace(heads, num_heads=1) != MultiHeadConfig():
        fields["multi_head"] = dataclasses.asdict(heads)
    if position_table_rows(model) not in (0, model.seq_length):
        fields["position_table_rows"] = position_table_rows(model)
    return fields


def run_fingerprint(run: "RunConfig") -> Dict:
    """The fingerprint of a run's model."""
    return model_fingerprint(run.model)


def check_fingerprint(saved: Dict, current: Dict, directory: str) -> None:
    """CheckpointError naming every differing STRUCTURAL field (a field the checkpoint
    predates compares with its ADDED_LATER value; other recorded fields are ignored)."""
    saved = {**ADDED_LATER, **saved}
    old, new = (dict(fields, extra=_structural_extra(fields.get("extra")))
                for fields in (saved, current))
    diffs = [f"{k}: checkpoint {old.get(k)!r} vs this run {new.get(k)!r}"
             for k in STRUCTURAL if old.get(k) != new.get(k)]
    if diffs:
        raise CheckpointError(f"{directory} is from an incompatible model; differing fields: "
                              + "; ".join(diffs) + ". Fix: use the checkpoint's model config "
                              "(its run_state.json 'config') or start without --load")


def _structural_extra(extra: Any) -> Any:
    if not isinstance(extra, dict):
        return extra
    return {k: v for k, v in extra.items() if k not in EXTRA_NOT_STRUCTURAL}


def changed_on_resume(saved: ModelSection, current: ModelSection) -> List[str]:
    """'field: checkpoint X -> this run Y' for every model field (nested ones dotted) that
    differs; after `check_fingerprint` passed these are the ones holding no parameters."""
    old, new = _leaves(dataclasses.asdict(saved)), _leaves(dataclasses.asdict(current))
    return [f"{k}: checkpoint {old.get(k)!r} -> this run {new.get(k)!r}"
            for k in sorted(set(old) | set(new))
            if k != "preset" and old.get(k) != new.get(k)]


def _leaves(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):  # extra too: each of its fields by name
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
