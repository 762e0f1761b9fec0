"""Which transformers class a model is exported as, and its config.json, field by field.

Design choices:
- A stock class is chosen only where it computes exactly what Megatron computes:
  | our model | class | why it matches |
  |---|---|---|
  | dense | LlamaForCausalLM | RMSNorm, RoPE (rotate-half), GQA, SwiGLU, no biases |
  | smoe, softmax top-k, no shared expert | MixtralForCausalLM | softmax over all logits, top-k, renormalised = Megatron's softmax over the top-k logits |
  | the same with QK layer norm | Qwen3MoeForCausalLM | Mixtral's routing (norm_topk_prob) + RMSNorm of each head's q and k before RoPE (q_norm / k_norm) |
  | smoe, sigmoid (+ expert bias), shared expert a multiple of the expert width | Glm4MoeForCausalLM | sigmoid, top-k on score + e_score_correction_bias, gates from the unbiased scores / (sum + 1e-20), x routed_scaling_factor; ungated shared experts |
  Everything else (latent, Multi-Router, Multi-View, MH-MoE, BitNet, pre-softmax routing,
  a dense/MoE layer mix, and Megatron-LM's QK layer norm outside that case, multi-latent
  attention (RoPE or YaRN), group-limited routing and shared-expert gates) is our own
  MVMoEForCausalLM
  (hf/remote/) through auto_map.
- Megatron settings that neither path computes are refused before anything is written,
  all of them in one error, each naming its field (`unsupported_settings`).
- The stock configs hold only what their classes read; our own config also keeps the run's
  whole model section (`megatron_mvmoe`), from which tools/import_hf.py rebuilds the run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

import torch

from megatron_mvmoe.config.variants import get_variant
from megatron_mvmoe.errors import require

OURS = "MVMoEForCausalLM"
STOCK_CLASSES = ("LlamaForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM",
                 "Glm4MoeForCausalLM")
HF_CLASSES = ("auto", "mvmoe") + STOCK_CLASSES
MODEL_TYPES = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral",
               "Qwen3MoeForCausalLM": "qwen3_moe", "Glm4MoeForCausalLM": "glm4_moe",
               OURS: "mvmoe"}

_FIXED = (  # (Megatron field, the value both exported paths compute with)
    ("normalization", "RMSNorm"), ("gated_linear_unit", True), ("add_bias_linear", False),
    ("add_qkv_bias", False), ("qk_l2_norm", False), ("rotary_interleaved", False),
    ("apply_residual_connection_post_layernorm", False),
    ("layernorm_zero_centered_gamma", False))
_MLA_FIXED = (("rotary_percent", 1.0), ("cache_mla_latents", False))

OPTIONS = ("qk_layernorm", "multi_latent_attention", "moe_router_num_groups",
           "moe_router_group_topk", "moe_shared_expert_gate")
"""Megatron-LM options only our class computes (QK norm alone: also Qwen3-MoE)."""


def unsupported_settings(config) -> None:
    """Refuse a Megatron setting the exported model lacks: one ValueError naming every
    such field with its fix (a user learns all of them in one pass)."""
    problems = [f"{name}: {got!r} is not expressed by the exported model (it computes "
                f"with {value!r}). Fix: export a model trained with {value!r}"
                for name, value, got in _mismatches(config)]
    act = config.activation_func
    if act is not torch.nn.functional.silu:
        problems.append(f"activation_func: {getattr(act, '__name__', act)} is not SwiGLU's "
                        "silu. Fix: export a model trained with --swiglu")
    if config.num_moe_experts and config.moe_router_score_function not in ("softmax",
                                                                           "sigmoid"):
        problems.append(f"moe_router_score_function: {config.moe_router_score_function!r} "
                        "routing is not exported. Fix: use softmax or sigmoid routing")
    if getattr(config, "multi_latent_attention", False) and getattr(
            config, "rope_type", "rope") not in ("rope", "yarn"):
        problems.append(f"rope_type: {config.rope_type!r} is not exported. Fix: use rope "
                        "or yarn")
    if problems:
        raise ValueError(f"{len(problems)} setting(s) not exported: " + "; ".join(problems))


def _mismatches(config):
    """(field, the value the export computes with, the model's) for each that differs."""
    fixed = _FIXED + (_MLA_FIXED if getattr(config, "multi_latent_attention", False) else ())
    for name, value in fixed:
        got = getattr(config, name, value)
        if got != value:
            yield name, value, got


def unsupported_architecture(model) -> None:
    """Refuse (ValueError naming the run-config field) what the exported classes do not
    compute: they have their own LM head and RoPE (GPT-3's tied embeddings and learned
    positions are model fields, outside Megatron's TransformerConfig)."""
    require(model.untie_embeddings_and_output_weights,
            "model.untie_embeddings_and_output_weights", "tied embeddings are not expressed "
            "by the exported model (it has its own LM head)",
            "export a model trained with --untie-embeddings-and-output-weights")
    require(model.position_embedding_type == "rope", "model.position_embedding_type",
            f"{model.position_embedding_type!r} is not expressed by the exported model "
            "(it computes with RoPE)", "export a model trained with "
            "--position-embedding-type rope")


def layer_types(state: Dict[str, torch.Tensor], num_layers: int) -> List[str]:
    """'moe' or 'dense' per layer, read from which MLP weights exist."""
    def is_moe(i: int) -> bool:
        return any(name.startswith(f"decoder.layers.{i}.mlp.") and ".router." in name
                   for name in state)
    return ["moe" if is_moe(i) else "dense" for i in range(num_layers)]


def gamma_state(state: Dict[str, torch.Tensor]) -> Optional[List[int]]:
    """[ramp_steps, step] of the Multi-View layers (all layers advance together)."""
    states = {tuple(int(v) for v in t.tolist()) for name, t in state.items()
              if name.endswith("mlp.gamma_ramp_state")}
    if not states:
        return None
    require(len(states) == 1, "gamma_ramp_state", f"layers disagree on the gamma ramp "
            f"{sorted(states)}", "export a checkpoint written by the trainer")
    return list(states.pop())


def choose_class(config, types: List[str], requested: str = "auto") -> str:
    """The class the model is written as (`requested`: auto, mvmoe or a stock class name)."""
    require(requested in HF_CLASSES, "--hf-class", f"unknown class {requested!r}",
            f"use one of {HF_CLASSES}")
    if requested == "mvmoe":
        return OURS
    stock = stock_class(config, types)
    if requested == "auto":
        return stock or OURS
    require(stock == requested, "--hf-class", f"{requested} does not compute this model "
            f"({_why_not_stock(config, types)})",
            f"use --hf-class {stock or 'mvmoe'} (or auto)")
    return requested


def stock_class(config, types: List[str]) -> Optional[str]:
    """The stock class that computes exactly this model, or None."""
    return None if _why_not_stock(config, types) else _stock_candidate(config)


def _stock_candidate(config) -> Optional[str]:
    if not get_variant(config.moe_variant).routed_experts:
        return "LlamaForCausalLM"
    if config.moe_router_score_function == "softmax":
        return "Qwen3MoeForCausalLM" if config.qk_layernorm else "MixtralForCausalLM"
    return "Glm4MoeForCausalLM"


def _why_not_stock(config, types: List[str]) -> Optional[str]:
    """None when the stock candidate computes the model, else the reason it does not."""
    if config.bitnet.enabled:
        return "BitNet's quantized forward"
    used = [name for name in OPTIONS if getattr(config, name, None)]
    qwen3 = (used == ["qk_layernorm"] and config.num_moe_experts
             and config.moe_router_score_function == "softmax")
    if used and not qwen3:
        return f"Megatron-LM's {', '.join(used)}"
    variant = get_variant(config.moe_variant)
    if not variant.routed_experts:
        return None
    if variant.moe_layer is not None:  # our own MoE layers have no stock HF class
        return f"variant {config.moe_variant}"
    if "dense" in types:
        return "a mix of dense and MoE layers"
    if config.moe_router_pre_softmax:
        return "pre-softmax routing"
    shared, width = config.moe_shared_expert_intermediate_size, config.moe_ffn_hidden_size
    if config.moe_router_score_function == "softmax":
        if shared:
            return "a shared expert with softmax routing"
        if config.moe_router_topk_scaling_factor:
            return "a top-k scaling factor with softmax routing"
        return None
    if not shared or shared % width:
        return "sigmoid routing needs a shared expert whose width is a multiple of the expert's"
    if config.num_moe_experts < 2:
        return "Glm4Moe's group scores need >= 2 experts"
    return None


def _common(config, model, vocab_size: int) -> Dict[str, Any]:
    return dict(vocab_size=vocab_size, hidden_size=config.hidden_size,
                num_hidden_layers=config.num_layers,
                num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_query_groups or config.num_attention_heads,
                head_dim=config.kv_channels, intermediate_size=config.ffn_hidden_size,
                rms_norm_eps=config.layernorm_epsilon, hidden_act="silu",
                max_position_embeddings=model.seq_length, tie_word_embeddings=False,
                attention_bias=False, mlp_bias=False)


def _rope(model) -> Dict[str, Any]:
    return dict(rope_parameters={"rope_type": "default", "rope_theta": float(model.rotary_base)})


def hf_config(hf_class: str, config, model, types: List[str], vocab_size: int,
              gamma: Optional[List[int]] = None) -> Dict[str, Any]:
    """config.json's model fields for `hf_class` (tokens ids are added by the writer)."""
    out = dict(_common(config, model, vocab_size), architectures=[hf_class],
               model_type=MODEL_TYPES[hf_class])
    if hf_class == "LlamaForCausalLM":
        return dict(out, **_rope(model))
    if hf_class == "MixtralForCausalLM":
        return dict(out, **_rope(model), num_local_experts=config.num_moe_experts,
                    num_experts_per_tok=config.moe_router_topk, sliding_window=None,
                    intermediate_size=config.moe_ffn_hidden_size, router_jitter_noise=0.0)
    if hf_class == "Qwen3MoeForCausalLM":
        return dict(out, **_rope(model), num_experts=config.num_moe_experts,
                    num_experts_per_tok=config.moe_router_topk,
                    moe_intermediate_size=config.moe_ffn_hidden_size, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
                    sliding_window=None)
    if hf_class == "Glm4MoeForCausalLM":
        rope = {**_rope(model)["rope_parameters"], "partial_rotary_factor": 1.0}
        return dict(out, rope_parameters=rope, n_routed_experts=config.num_moe_experts,
                    num_experts_per_tok=config.moe_router_topk,
                    moe_intermediate_size=config.moe_ffn_hidden_size,
                    n_shared_experts=config.moe_shared_expert_intermediate_size
                    // config.moe_ffn_hidden_size,
                    routed_scaling_factor=float(config.moe_router_topk_scaling_factor or 1.0),
                    norm_topk_prob=config.moe_router_topk > 1, n_group=1, topk_group=1,
                    first_k_dense_replace=0, use_qk_norm=False, num_nextn_predict_layers=0)
    return dict(out, **_ours(config, model, types, gamma or [0, 0]))


def hf_structure(moe_variant: str) -> str:
    """The remote code's MoE structure that computes `moe_variant` (its record's
    `hf_structure`, written as the exported `moe_variant`); refused without one."""
    structure = get_variant(moe_variant).hf_structure
    require(structure is not None, "moe_variant", f"no exported model class computes "
            f"variant {moe_variant!r} (its record has no hf_structure)",
            "give the variant's record the remote-code structure that computes it")
    return structure


def _ours(config, model, types: List[str], gamma: List[int]) -> Dict[str, Any]:
    mv, mh, bitnet = config.multi_view, config.multi_head, config.bitnet
    return dict(
        rope_theta=float(model.rotary_base), moe_variant=hf_structure(config.moe_variant),
        mlp_layer_types=types, num_experts=config.num_moe_experts,
        moe_intermediate_size=config.moe_ffn_hidden_size,
        num_experts_per_tok=config.moe_router_topk,
        router_score_function=config.moe_router_score_function,
        router_pre_softmax=bool(config.moe_router_pre_softmax),
        router_topk_scaling_factor=config.moe_router_topk_scaling_factor,
        router_expert_bias=bool(config.moe_router_enable_expert_bias),
        shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        latent_size=config.latent_size, num_routers=mv.num_routers, num_views=mv.num_views,
        normalizer_eps=mv.normalizer_eps, gate_scale=mv.gate_scale,
        learned_gate_scale=mv.learned_gate_scale, gamma_ramp_steps=gamma[0],
        gamma_step=gamma[1], mh_num_heads=mh.num_heads if mh.split_tokens else 1,
        mh_head_projection=mh.head_projection, mh_merge_projection=mh.merge_projection,
        bitnet=bitnet.enabled, bitnet_activation_bits=bitnet.activation_bits,
        bitnet_input_norm=bitnet.input_norm, megatron_mvmoe=model_section_dict(model),
        **_megatron_lm_options(config),
        auto_map={"AutoConfig": "configuration_mvmoe.MVMoEConfig",
                  "AutoModelForCausalLM": "modeling_mvmoe.MVMoEForCausalLM"})


def _megatron_lm_options(config) -> Dict[str, Any]:
    """QK norm, group-limited routing, the shared-expert gate and MLA's fields."""
    out = dict(qk_layernorm=bool(config.qk_layernorm),
               router_num_groups=config.moe_router_num_groups,
               router_group_topk=config.moe_router_group_topk,
               shared_expert_gate=bool(config.moe_shared_expert_gate),
               multi_latent_attention=bool(getattr(config, "multi_latent_attention", False)))
    if out["multi_latent_attention"]:
        out.update({name: getattr(config, name) for name in MLA_FIELDS})
    return out


MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim", "rope_type", "rotary_scaling_factor",
              "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim")


def model_section_dict(model) -> Dict[str, Any]:
    """The run's model section as plain JSON values."""
    return json_safe(dataclasses.asdict(model))


def json_safe(value):
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value if value is None or isinstance(value, (str, int, float, bool)) else str(value)
