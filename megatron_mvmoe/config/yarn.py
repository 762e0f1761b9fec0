"""YaRN rotary embedding of standard (non-MLA) attention, as Megatron-LM builds it.

Megatron-Core's GPTModel builds `YarnRotaryEmbedding` for `position_embedding_type: yarn`
and reads its parameters as `config.yarn_*` attributes that TransformerConfig does not
declare; Megatron-LM (core_r0.19.0, `argument_utils._apply_yarn_config_from_args`) sets
them on the config from its flags, with YarnRotaryEmbedding's defaults (YARN_DEFAULTS). Here
they are declared fields of MVMoETransformerConfig (config/transformer_config.py), carried
in `model.extra` like every Megatron field we do not model, so a run config and a
checkpoint record them.

Spellings, exactly as Megatron-LM reads them: `--yarn-original-max-position-embeddings`,
`--yarn-beta-fast`, `--yarn-beta-slow`, `--[no-]yarn-correction-range-round-to-int` are
the yarn_* fields; the scaling factor and the two mscales have no yarn_ flag: Megatron-LM
takes MLA's `--rotary-scaling-factor`, `--mscale`, `--mscale-all-dim` for them when the
model is YaRN without MLA (`MLA_SPELLINGS`; with MLA they stay MLA's own fields).

Refused in one line naming the field: YaRN positions with MLA (MLA has its own YaRN,
`--rope-type yarn`; Megatron-LM's GPTModel would read yarn_* attributes its MLA config
never gets), and a yarn_* field on a model without YaRN positions (nothing reads it).
"""

from __future__ import annotations

from typing import Any, Dict

from megatron_mvmoe.errors import require

YARN_DEFAULTS: Dict[str, Any] = {
    "yarn_rotary_scaling_factor": 1.0,
    "yarn_original_max_position_embeddings": 4096,
    "yarn_beta_fast": 32.0,
    "yarn_beta_slow": 1.0,
    "yarn_mscale": 1.0,
    "yarn_mscale_all_dim": 0.0,
    "yarn_correction_range_round_to_int": True,
}
"""Megatron-LM's values for a YaRN line that leaves a flag out (_apply_yarn_config_from_args,
which mirrors YarnRotaryEmbedding's defaults)."""

MLA_SPELLINGS = {"rotary_scaling_factor": "yarn_rotary_scaling_factor",
                 "mscale": "yarn_mscale", "mscale_all_dim": "yarn_mscale_all_dim"}
"""MLA's flag fields -> the yarn_* field they set on a YaRN model without MLA."""


def is_standard_yarn(position_embedding_type: Any, extra: Dict[str, Any]) -> bool:
    return position_embedding_type == "yarn" and not extra.get("multi_latent_attention")


def respell_mla_flags(model: Dict[str, Any]) -> None:
    """A raw model section from flags (in place): on a YaRN model without MLA,
    --rotary-scaling-factor / --mscale / --mscale-all-dim are the yarn_* fields, as
    Megatron-LM maps them."""
    extra = model.get("extra") or {}
    if not is_standard_yarn(model.get("position_embedding_type"), extra):
        return
    for mla_name, yarn_name in MLA_SPELLINGS.items():
        if mla_name in extra:
            extra[yarn_name] = extra.pop(mla_name)


def check_yarn(position_embedding_type: str, extra: Dict[str, Any]) -> None:
    """The YaRN refusals of the module docstring."""
    require(not (position_embedding_type == "yarn" and extra.get("multi_latent_attention")),
            "model.position_embedding_type",
            "yarn with multi-latent attention: MLA builds its own rotary embedding",
            "use --position-embedding-type rope with --rope-type yarn (MLA's YaRN, its "
            "default)")
    given = sorted(name for name in YARN_DEFAULTS if name in extra)
    require(position_embedding_type == "yarn" or not given,
            f"model.extra.{given[0]}" if given else "model.extra",
            f"{given} act only with YaRN positions (nothing reads them otherwise)",
            "add --position-embedding-type yarn or drop them")

