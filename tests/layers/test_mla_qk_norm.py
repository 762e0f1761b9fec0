"""Multi-latent attention and QK layer norm in the decoder block of every variant (issue 22,
features 3): the block holds Megatron's MLASelfAttention with the variant's MoE layer,
--qk-layernorm adds the norms (standard attention: q/k over each head; MLA: the q/kv
latents), and TP=2 x EP=2 (sequence parallel) gives the single-rank loss and gradients
within the layout-parity tolerance of test_multi_view_layouts.py (1e-5)."""

import pytest
import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from megatron_mvmoe.config.mla_config import MVMoEMLATransformerConfig, megatron_config_class
from megatron_mvmoe.config.transformer_config import MVMoETransformerConfig
from megatron_mvmoe.layers.builders import module_of
from megatron_mvmoe.layers.local_mla import LocalMLASelfAttention, MLADotProductAttention
from megatron_mvmoe.models.specs import build_decoder_block_spec
from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.testing.gpt_harness import (assert_matches_reference, build_gpt,
                                                global_batch, train_step_losses_and_grads)
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import mv_config

VOCAB, SEQ, BATCH, MICRO = 64, 8, 4, 1
MLA = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=8, rope_type="rope")
"""A tiny MLA: 4 heads of 8 + 4 (RoPE part) query/key dims, 8 value dims."""
MLP_CLASS = {"smoe": "MoELayer", "latent": "LatentMoELayer", "multi_router": "LatentMoELayer",
             "multi_view": "MultiViewMoELayer", "mh_moe": "MultiHeadMoELayer"}


def mla_config(variant: str, qk_layernorm: bool = True, **overrides):
    """mv_config's tiny model of `variant` with Megatron's MLA in every layer."""
    base = mv_config(variant, num_routers=1 if variant == "latent" else 2, **overrides)
    kwargs = {f: getattr(base, f) for f in base.__dataclass_fields__
              if f in MVMoETransformerConfig.__dataclass_fields__ and f != "recompute_modules"}
    kwargs.update(MLA, qk_layernorm=qk_layernorm)
    if variant == "mh_moe":
        kwargs["multi_head"] = type(base.multi_head)(num_heads=2)
    return megatron_config_class(kwargs)(**kwargs)


def _attention_and_mlp(block):
    out = []
    for spec in block.layer_specs:
        attention = spec.submodules.self_attention
        out.append((attention.module, module_of(spec.submodules.mlp).__name__,
                    {slot: getattr(attention.submodules, slot) for slot in
                     ("q_layernorm", "k_layernorm", "kv_layernorm")
                     if hasattr(attention.submodules, slot)}))
    return out


def _spec_worker(rank, world_size):
    initialize_layout(ParallelLayout())
    out = {}
    for variant in MLP_CLASS:
        for qk in (False, True):
            out[(variant, qk)] = _attention_and_mlp(build_decoder_block_spec(
                mla_config(variant, qk_layernorm=qk)))
    standard = mv_config("multi_view", qk_layernorm=True)
    out["standard_qk"] = _attention_and_mlp(build_decoder_block_spec(standard))
    return out


def test_block_holds_megatron_mla_and_the_variant_moe_layer():
    specs = run_distributed(_spec_worker, 1)[0]
    for variant, mlp in MLP_CLASS.items():
        for qk in (False, True):
            layers = specs[(variant, qk)]
            assert [(a, m) for a, m, _ in layers] == [(LocalMLASelfAttention, mlp)] * 2, variant
            assert issubclass(LocalMLASelfAttention, MLASelfAttention)
            for _, _, norms in layers:
                assert set(norms) == {"q_layernorm", "kv_layernorm"}
                assert all((norm is IdentityOp) != qk for norm in norms.values()), norms
    for attention, _, norms in specs["standard_qk"]:
        assert attention is SelfAttention
        assert all(norm is not IdentityOp for norm in norms.values()) and len(norms) == 2


def _step(rank, world_size, variant, tp, ep, qk_layernorm, standard):
    pgs = initialize_layout(ParallelLayout(tp=tp, ep=ep))
    parallel = dict(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                    expert_tensor_parallel_size=1, sequence_parallel=tp > 1)
    config = (mv_config(variant, num_routers=2, qk_layernorm=qk_layernorm, **parallel)
              if standard else mla_config(variant, qk_layernorm=qk_layernorm, **parallel))
    model = build_gpt(config, build_decoder_block_spec(config), VOCAB, SEQ, pgs)
    out = train_step_losses_and_grads(model, config, global_batch(BATCH, SEQ, VOCAB), MICRO,
                                      pgs)
    out["mla"] = [isinstance(m, MLASelfAttention) for m in model.modules()].count(True)
    out["norms"] = sorted(n for n, _ in model.named_parameters() if "q_layernorm" in n
                          or "kv_layernorm" in n or "k_layernorm" in n)
    return out


@pytest.mark.parametrize("variant,qk_layernorm,standard", [
    ("multi_view", True, False), ("smoe", True, False), ("mh_moe", False, False),
    ("multi_router", True, True)], ids=["mla_qk_multi_view", "mla_qk_smoe", "mla_mh_moe",
                                        "qk_norm_multi_router"])
def test_tp2_sp_ep2_matches_single_rank(variant, qk_layernorm, standard):
    """TP=2 x EP=2 on 2 ranks (experts split over the TP ranks, ETP=1): the attention
    heads, MLA's up-projections and the sequence are split; loss and every gradient equal
    the single-rank run's (the QK norms' grads are partial per rank and summed over TP)."""
    reference = run_distributed(_step, 1, args=(variant, 1, 1, qk_layernorm, standard))[0]
    results = run_distributed(_step, 2, args=(variant, 2, 2, qk_layernorm, standard))
    assert_matches_reference(results, reference)
    assert reference["mla"] == (0 if standard else 2)
    assert bool(reference["norms"]) == qk_layernorm
    assert reference["loss"] > 0 and all(r["loss"] == results[0]["loss"] for r in results)


def test_megatron_local_attention_still_lacks_mla_head_widths():
    """When this fails, Megatron's DotProductAttention takes MLA's k/v widths itself
    (Megatron-LM PR 6564): drop MLADotProductAttention from layers/local_mla.py."""
    import inspect
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    assert "k_channels" not in inspect.signature(DotProductAttention.__init__).parameters
    assert "v_channels" in inspect.signature(MLADotProductAttention.__init__).parameters


def test_mla_fields_without_mla_and_local_q_norm_are_refused():
    with pytest.raises(ValueError, match="model.extra.kv_lora_rank: .*multi_latent_attention "
                                         "is off.*Fix: add --multi-latent-attention"):
        megatron_config_class({"kv_lora_rank": 8})
    assert megatron_config_class({"rope_type": "rope"}) is MVMoETransformerConfig
    with pytest.raises(ValueError, match="num_query_groups: 2 KV groups with multi-latent"):
        mla_config("smoe", num_query_groups=2)
    config = mla_config("latent")
    config.q_lora_rank = None
    with pytest.raises(ValueError, match="q_lora_rank: --qk-layernorm with MLA and no "
                                         "q_lora_rank.*Fix: set --q-lora-rank"):
        build_decoder_block_spec(config)
    assert isinstance(mla_config("smoe"), MVMoEMLATransformerConfig)


def _attention_params_worker(rank, world_size, extra):
    from megatron_mvmoe.config.model_costs import attention_params
    from megatron_mvmoe.config.model_section import model_section_from_dict
    from megatron_mvmoe.models.provider import build_gpt_chunk, transformer_config

    initialize_layout(ParallelLayout())
    section = model_section_from_dict(dict(preset="tiny_multi_view", extra=dict(extra)))
    model = build_gpt_chunk(transformer_config(section), section)
    layer = model.decoder.layers[0]
    built = sum(p.numel() for part in (layer.self_attention, layer.input_layernorm,
                                       layer.pre_mlp_layernorm) for p in part.parameters())
    return built, attention_params(section)


@pytest.mark.parametrize("extra", [
    {}, {"qk_layernorm": True}, {"multi_latent_attention": True},
    {"multi_latent_attention": True, "qk_layernorm": True, "q_lora_rank": 24,
     "kv_lora_rank": 12, "qk_head_dim": 8, "qk_pos_emb_head_dim": 4, "v_head_dim": 12}],
    ids=["standard", "qk_norm", "mla_defaults", "mla_qk_lora"])
def test_planner_counts_the_built_attention(extra):
    """planning/plan.py's attention parameters equal the built layer's (the planner sizes
    MLA and QK-norm models from the same fields)."""
    built, planned = run_distributed(_attention_params_worker, 1, args=(extra,))[0]
    assert built == planned, (built, planned)
