"""Whole-model parameters and FLOPs per token of a ModelSection: what the planner prints and
the trainer's MFU divides by. Below training and analysis (config/: counting only; Megatron
is imported only to read MLA's defaults), so both ask the same numbers.

Design choices:
- Parameter counts are analytic, per module, mirroring what models/provider.py builds
  (Megatron's local spec) for the model's architecture fields: RMSNorm (weight) or
  LayerNorm (weight and bias), SwiGLU fc1 of 2F rows or GeLU of F, biases or none, untied
  LM head or the embedding reused, RoPE or a learned table of max_position_embeddings positions); an MoE
  layer's count is its variant record's
  (config/variants.py, `Variant.layer_params`). tests/planning/test_plan.py checks them
  against the built tiny models exactly.
- Layer placement is Megatron's `moe_layer_freq` (`moe_layer_pattern`): the seed-2 family's
  MoE layers alternate with dense SwiGLU FFNs of `ffn_hidden_size`.
- "Active" = every non-expert parameter + k routed experts per MoE layer (H k for MH-MoE;
  embedding and LM head included; `active_without_embeddings` is given too).
- FLOPs per token: 2 x active matmul parameters (the embedding lookup excluded) + attention
  scores/values 4 x S x D per layer (non-causal count); training = 3 x forward.
"""

from __future__ import annotations

from typing import Dict, Tuple

from megatron_mvmoe.config.model_section import ModelSection, position_table_rows
from megatron_mvmoe.config.variants import GELU_MATRICES, SWIGLU_MATRICES, MoEDims
from megatron_mvmoe.errors import require


def norm_params(m: ModelSection, width: int) -> int:
    """One norm over `width`: RMSNorm's weight, LayerNorm's weight and bias."""
    return width * (2 if m.normalization == "LayerNorm" else 1)


def attention_params(m: ModelSection) -> int:
    """One layer's attention (standard or MLA) plus its input and pre-MLP norms."""
    norms = 2 * norm_params(m, m.hidden_size)
    if m.extra.get("multi_latent_attention"):
        return mla_params(m) + norms
    kv_channels = m.hidden_size // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    qkv_rows = (m.num_attention_heads + 2 * groups) * kv_channels
    qkv = qkv_rows * m.hidden_size
    proj = m.hidden_size * m.num_attention_heads * kv_channels
    biases = qkv_rows + m.hidden_size if m.add_bias_linear else 0
    qk_norms = 2 * norm_params(m, kv_channels) if m.extra.get("qk_layernorm") else 0
    return qkv + proj + biases + qk_norms + norms


def mla_params(m: ModelSection) -> int:
    """Megatron's MLASelfAttention (config/mla_config.py's defaults for fields not set): query
    projection (direct, or down to q_lora_rank and up), the kv down projection to the latent
    plus the RoPE key part, the kv up projection to per-head keys and values, the output
    projection, and the q/kv latent norms with --qk-layernorm."""
    from megatron_mvmoe.config.mla_config import MVMoEMLATransformerConfig

    defaults = MVMoEMLATransformerConfig.__dataclass_fields__

    def field(name):
        return m.extra.get(name, defaults[name].default)

    D, h = m.hidden_size, m.num_attention_heads
    qk, pos, v = field("qk_head_dim"), field("qk_pos_emb_head_dim"), field("v_head_dim")
    q_rank, kv_rank, norms = field("q_lora_rank"), field("kv_lora_rank"), \
        bool(m.extra.get("qk_layernorm"))
    if q_rank is None:
        query = D * h * (qk + pos)
    else:
        query = D * q_rank + q_rank * h * (qk + pos) + (norm_params(m, q_rank) if norms else 0)
    kv = D * (kv_rank + pos) + kv_rank * h * (qk + v) + \
        (norm_params(m, kv_rank) if norms else 0)
    return query + kv + h * v * D


def swiglu(d_in: int, width: int) -> int:
    return SWIGLU_MATRICES * d_in * width  # fc1 [2F, d_in] + fc2 [d_in, F]


def dense_mlp_params(m: ModelSection, d_in: int, width: int) -> int:
    """A dense MLP of the model's architecture: gated (SwiGLU, quick-GeGLU) or GeLU, with or
    without biases."""
    matrices = SWIGLU_MATRICES if m.gated_mlp else GELU_MATRICES
    biases = (matrices - 1) * width + d_in if m.add_bias_linear else 0
    return matrices * d_in * width + biases


def moe_params(m: ModelSection) -> Dict[str, int]:
    """One MoE layer's parameters split into expert and non-expert (the variant's count)."""
    per = m.variant.layer_params(MoEDims.of(m))
    return {"expert_one": per.expert, "router": per.router, "projections": per.projections,
            "shared": per.shared}


def mtp_num_layers(m: ModelSection) -> int:
    """Multi-token prediction depth (Megatron's `mtp_num_layers`, given through `extra`)."""
    return int(m.extra.get("mtp_num_layers") or 0)


def moe_layer_pattern(m: ModelSection) -> Tuple[bool, ...]:
    """Which decoder layers are MoE, Megatron's `moe_layer_freq` (in `extra`; default 1):
    an int N makes layer i (0-based) MoE when i % N == 0, a list gives 1/0 per layer."""
    if not m.is_moe:
        return (False,) * m.num_layers
    freq = m.extra.get("moe_layer_freq", 1)
    if isinstance(freq, int):
        return tuple(i % freq == 0 for i in range(m.num_layers))
    require(len(freq) == m.num_layers, "extra.moe_layer_freq",
            f"a pattern of {len(freq)} layers for num_layers {m.num_layers}",
            "give one 0/1 entry per layer")
    return tuple(bool(x) for x in freq)


def _dense_mlp(m: ModelSection) -> Dict[str, int]:
    dense = dense_mlp_params(m, m.hidden_size, m.ffn_hidden_size)
    return {"dense": dense, "non_expert": 0, "experts": 0, "active": dense}


def _layer_mlp(m: ModelSection, moe: bool = True) -> Dict[str, int]:
    """One decoder layer's MLP (an MoE one when `moe` and the model has experts): all its
    parameters, its experts, and what one token uses."""
    if not (moe and m.is_moe):
        return _dense_mlp(m)
    per = m.variant.layer_params(MoEDims.of(m))
    non_expert = per.router + per.projections + per.shared
    return {"dense": 0, "non_expert": non_expert, "experts": per.experts_total,
            "active": per.active}


def mtp_params(m: ModelSection) -> Dict[str, int]:
    """The MTP block (models/mtp_spec.py: Megatron's MultiTokenPredictionLayer): per layer
    enorm + hnorm + final norm (D each), eh_proj [D, 2D], and a copy of the last decoder
    layer (attention + its MLP). Embedding and LM head are the main model's (shared)."""
    n = mtp_num_layers(m)
    D, mlp = m.hidden_size, _layer_mlp(m, moe=moe_layer_pattern(m)[-1])  # the last layer's
    own = 3 * norm_params(m, D) + 2 * D * D + attention_params(m)
    return {"total": n * (own + mlp["dense"] + mlp["non_expert"] + mlp["experts"]),
            "active": n * (own + mlp["active"]), "experts": n * mlp["experts"],
            "non_expert": n * (own + mlp["dense"] + mlp["non_expert"])}


def parameter_counts(m: ModelSection) -> Dict[str, int]:
    """Every parameter the provider builds, MTP layers included ("mtp": their share)."""
    D, V = m.hidden_size, m.vocab_size
    positions = position_table_rows(m) * D
    embedding, final_norm = V * D + positions, norm_params(m, D)
    head = V * D if m.untie_embeddings_and_output_weights else 0
    attention = attention_params(m) * m.num_layers
    pattern, mtp = moe_layer_pattern(m), mtp_params(m)
    mlps = [_layer_mlp(m, moe) for moe in pattern]
    dense = sum(mlp["dense"] for mlp in mlps)
    non_expert_moe = sum(mlp["non_expert"] for mlp in mlps)
    experts = sum(mlp["experts"] for mlp in mlps)
    base = embedding + head + final_norm + attention + dense + non_expert_moe
    active = base + sum(mlp["active"] - mlp["dense"] - mlp["non_expert"] for mlp in mlps) \
        + mtp["active"]
    return {"total": base + experts + mtp["total"], "active": active,
            "active_without_embeddings": active - embedding - head,
            "embedding": embedding, "lm_head": head, "attention": attention,
            "experts": experts, "expert_one": moe_params(m)["expert_one"] if m.is_moe else 0,
            "non_expert_moe": non_expert_moe, "dense_mlp": dense, "mtp": mtp["total"]}


def flops_per_token(m: ModelSection) -> Dict[str, float]:
    """Forward and training (3 x forward) FLOPs per token. Each MTP layer adds its own active
    matmuls plus one more pass of the shared LM head, and one more layer of attention
    scores."""
    counts = parameter_counts(m)
    n_mtp = mtp_num_layers(m)
    head_matmul = m.vocab_size * m.hidden_size  # the LM head's, tied or not
    matmul = counts["active"] - counts["embedding"] - counts["lm_head"] + \
        (1 + n_mtp) * head_matmul
    attention_scores = 4 * m.seq_length * m.hidden_size * (m.num_layers + n_mtp)
    forward = 2 * matmul + attention_scores
    return {"forward": float(forward), "train": float(3 * forward)}
