"""Multi-latent attention (MLA) for every variant: `MVMoEMLATransformerConfig` and the rule
that picks the Megatron config class of a model (`megatron_config_class`).

Design choices:
- Megatron-Core's MLA modules (`MLASelfAttention`, its RoPE / YaRN embedding, the Q/KV norm
  resolver) read `q_lora_rank`, `kv_lora_rank`, `qk_head_dim`, ... from the config they are
  built with, and Megatron-LM builds an `MLATransformerConfig` for `--multi-latent-attention`.
  Our variants need `MVMoETransformerConfig`'s fields at the same time, so the MLA config is
  both: `MVMoEMLATransformerConfig(MVMoETransformerConfig, MLATransformerConfig)` (one
  dataclass; `__post_init__` runs ours, then MLA's, then TransformerConfig's). The decoder
  block then comes from Megatron's own `get_gpt_decoder_block_spec`, which puts MLA in every
  layer when `config.multi_latent_attention` is set; only the MoE slots are swapped as always.
- Defaults are Megatron-LM's command-line defaults (`_add_mla_args` in arguments.py:
  q_lora_rank None, kv_lora_rank 32, rotary_scaling_factor 1.0), not MLATransformerConfig's
  DeepSeek-V3 values (512, 512, 40): a launch line means here what it means in Megatron-LM.
  `rope_type` keeps MLATransformerConfig's 'yarn' (Megatron-LM pops an unset --rope-type).
- MLA fields on a model without MLA are refused naming the field; `rope_type: rope` is what
  standard attention always does, so it is dropped there, and `yarn` is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Type

from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_mvmoe.config.transformer_config import MVMoETransformerConfig
from megatron_mvmoe.errors import require


@dataclass
class MVMoEMLATransformerConfig(MVMoETransformerConfig, MLATransformerConfig):
    """MVMoETransformerConfig with Megatron-Core's multi-latent attention fields."""

    q_lora_rank: Optional[int] = None
    """Rank of the query's low-rank projection (None: queries projected directly;
    Megatron-LM's --q-lora-rank default)."""

    kv_lora_rank: int = 32
    """Rank of the shared key/value latent (Megatron-LM's --kv-lora-rank default)."""

    rotary_scaling_factor: float = 1.0
    """YaRN scaling factor (Megatron-LM's --rotary-scaling-factor default: no scaling)."""

    def validate_mvmoe(self) -> None:
        super().validate_mvmoe()
        heads = self.num_attention_heads
        require(self.num_query_groups in (None, heads), "num_query_groups",
                f"{self.num_query_groups} KV groups with multi-latent attention: MLA's keys "
                "and values come from one shared latent (kv_lora_rank), it has no KV groups",
                "leave num_query_groups unset (Megatron-LM: drop --group-query-attention)")
        require(not self.bitnet.enabled, "bitnet.enabled",
                "MLA's down projections accept only Megatron's own linear classes, so the "
                "Bit linears cannot be swapped in", "drop --bitnet or --multi-latent-attention")
        require(not self.cache_mla_latents, "cache_mla_latents",
                "latent caching is for Megatron's dynamic inference backend (Flash MLA)",
                "leave it False for pretraining")


MLA_FIELDS = tuple(sorted(
    {f.name for f in dataclasses.fields(MVMoEMLATransformerConfig)}
    - {f.name for f in dataclasses.fields(MVMoETransformerConfig)}))
"""Fields only the MLA config has (q_lora_rank, kv_lora_rank, qk_head_dim, rope_type, ...)."""


def megatron_config_class(kwargs: Dict[str, Any]) -> Type[MVMoETransformerConfig]:
    """The config class for these keyword arguments (MLA when multi_latent_attention is set);
    drops `rope_type='rope'` from a standard-attention model (what it always does) and
    refuses the other MLA-only fields there. Mutates `kwargs`."""
    if kwargs.get("multi_latent_attention"):
        return MVMoEMLATransformerConfig
    if kwargs.get("rope_type") == "rope":
        kwargs.pop("rope_type")
    given = sorted(name for name in MLA_FIELDS if name in kwargs)
    require(not given, f"model.extra.{given[0]}" if given else "model.extra",
            f"{given} are multi-latent attention fields but multi_latent_attention is off "
            "(standard attention has plain RoPE and no latent ranks)",
            "add --multi-latent-attention (model.extra.multi_latent_attention: true) or drop "
            "them")
    return MVMoETransformerConfig
