"""The class mapping, field by field, without training: which class each model is written
as (and the refusals), that every mapped field lands where the stock class reads it, and
that each of those fields changes the stock model's logits (so the logits-equality tests of
test_export_equality.py fail when one is mapped wrong)."""

import copy

import pytest
import torch

from megatron_mvmoe.config.model_section import model_from_preset
from megatron_mvmoe.hf import config_map
from megatron_mvmoe.models.provider import transformer_config

transformers = pytest.importorskip("transformers")


def _config(preset, shared=None, **extra):
    model = model_from_preset(preset, vocab_size=128, seq_length=32, extra=extra,
                              moe_shared_expert_intermediate_size=shared)
    return transformer_config(model), model


SIGMOID = dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)


@pytest.mark.parametrize("preset,extra,expected", [
    ("tiny_dense", {}, "LlamaForCausalLM"),
    ("tiny_smoe", {}, "MixtralForCausalLM"),
    ("tiny_smoe", dict(SIGMOID, moe_shared_expert_intermediate_size=128), "Glm4MoeForCausalLM"),
    ("tiny_smoe", dict(moe_router_pre_softmax=True), "MVMoEForCausalLM"),
    ("tiny_smoe", dict(moe_shared_expert_intermediate_size=64), "MVMoEForCausalLM"),
    ("tiny_smoe", dict(SIGMOID, moe_shared_expert_intermediate_size=96), "MVMoEForCausalLM"),
    ("tiny_smoe", dict(moe_router_topk_scaling_factor=2.0), "MVMoEForCausalLM"),
    ("tiny_latent", {}, "MVMoEForCausalLM"),
    ("tiny_multi_view", {}, "MVMoEForCausalLM"),
    ("tiny_mh_moe", {}, "MVMoEForCausalLM"),
    # Megatron-LM's options no stock class we write computes (issue 36)
    ("tiny_smoe", dict(qk_layernorm=True), "Qwen3MoeForCausalLM"),
    ("tiny_dense", dict(qk_layernorm=True), "MVMoEForCausalLM"),
    ("tiny_smoe", dict(SIGMOID, moe_shared_expert_intermediate_size=128, qk_layernorm=True),
     "MVMoEForCausalLM"),
    ("tiny_smoe", dict(SIGMOID, moe_shared_expert_intermediate_size=128,
                       moe_router_num_groups=2, moe_router_group_topk=1), "MVMoEForCausalLM"),
    ("tiny_smoe", dict(SIGMOID, moe_shared_expert_intermediate_size=128,
                       moe_shared_expert_gate=True), "MVMoEForCausalLM"),
    ("tiny_dense", dict(multi_latent_attention=True), "MVMoEForCausalLM"),
])
def test_class_choice(preset, extra, expected):
    shared = extra.pop("moe_shared_expert_intermediate_size", None)
    model = model_from_preset(preset, vocab_size=128, seq_length=32, extra=extra,
                              moe_shared_expert_intermediate_size=shared)
    config = transformer_config(model)
    types = ["dense" if preset == "tiny_dense" else "moe"] * 2
    assert config_map.choose_class(config, types) == expected


def test_bitnet_and_layer_mix_go_to_our_class_and_a_wrong_request_is_refused():
    config, _ = _config("tiny_smoe")
    assert config_map.choose_class(config, ["dense", "moe"]) == "MVMoEForCausalLM"
    config.bitnet.enabled = True
    assert config_map.choose_class(config, ["moe", "moe"]) == "MVMoEForCausalLM"
    latent, _ = _config("tiny_latent")
    with pytest.raises(ValueError, match=r"--hf-class: MixtralForCausalLM does not compute"):
        config_map.choose_class(latent, ["moe", "moe"], "MixtralForCausalLM")
    config.bitnet.enabled = False
    config.qk_layernorm = True  # Megatron-LM's options: our class computes them (issue 36)
    config_map.unsupported_settings(config)
    assert config_map.choose_class(config, ["moe", "moe"]) == "Qwen3MoeForCausalLM"
    config.moe_router_num_groups, config.moe_router_group_topk = 2, 1
    assert config_map.choose_class(config, ["moe", "moe"]) == "MVMoEForCausalLM"


def test_every_setting_the_export_cannot_express_is_named_in_one_error():
    config, _ = _config("tiny_smoe")
    config.normalization, config.add_bias_linear = "LayerNorm", True
    config.activation_func = torch.nn.functional.gelu
    with pytest.raises(ValueError, match=r"^3 setting\(s\) not exported: ") as err:
        config_map.unsupported_settings(config)
    for name in ("normalization: 'LayerNorm'", "add_bias_linear: True",
                 "activation_func: gelu"):
        assert name in str(err.value), err.value
    assert str(err.value).count("Fix:") == 3


def _stock_pair(hf_class, preset, shared=None, **extra):
    config, model = _config(preset, shared, **extra)
    fields = config_map.hf_config(hf_class, config, model, ["moe", "moe"], 128)
    return config, model, fields


def test_fields_land_where_the_stock_classes_read_them():
    config, model, f = _stock_pair("MixtralForCausalLM", "tiny_smoe")
    hf = transformers.MixtralConfig(**{k: v for k, v in f.items() if k != "architectures"})
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads) == (
        config.hidden_size, config.num_layers, config.num_attention_heads)
    assert hf.num_key_value_heads == (config.num_query_groups or config.num_attention_heads)
    assert hf.head_dim == config.kv_channels and hf.rms_norm_eps == config.layernorm_epsilon
    assert hf.rope_parameters["rope_theta"] == model.rotary_base
    assert (hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size) == (
        config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size)
    config, model, f = _stock_pair("Glm4MoeForCausalLM", "tiny_smoe", 128, **SIGMOID,
                                   moe_router_topk_scaling_factor=2.5)
    hf = transformers.Glm4MoeConfig(**{k: v for k, v in f.items() if k != "architectures"})
    assert (hf.n_routed_experts, hf.n_shared_experts, hf.moe_intermediate_size) == (4, 2, 64)
    assert hf.routed_scaling_factor == 2.5 and hf.norm_topk_prob is True
    assert (hf.n_group, hf.topk_group, hf.first_k_dense_replace) == (1, 1, 0)


MIXTRAL_PERTURB = {"rope_theta": 500.0, "rms_norm_eps": 0.5, "num_experts_per_tok": 1}
GLM_PERTURB = dict(MIXTRAL_PERTURB, routed_scaling_factor=3.0, norm_topk_prob=False)


@pytest.mark.parametrize("hf_class,perturb", [("MixtralForCausalLM", MIXTRAL_PERTURB),
                                              ("Qwen3MoeForCausalLM", MIXTRAL_PERTURB),
                                              ("Glm4MoeForCausalLM", GLM_PERTURB)])
def test_each_mapped_field_changes_the_logits(hf_class, perturb):
    extra = {"Glm4MoeForCausalLM": SIGMOID,
             "Qwen3MoeForCausalLM": dict(qk_layernorm=True)}.get(hf_class, {})
    shared = 128 if hf_class == "Glm4MoeForCausalLM" else None
    _, _, fields = _stock_pair(hf_class, "tiny_smoe", shared, **extra)
    cls = getattr(transformers, hf_class)
    config_cls = getattr(transformers, hf_class.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (1, 24))

    def logits(values):
        hf = config_cls(**{k: v for k, v in values.items() if k != "architectures"})
        torch.manual_seed(1)
        model = cls(hf).eval()
        for name, param in model.named_parameters():  # N(0, 0.3): routing that matters
            param.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(hash(name) % 997))
        with torch.no_grad():
            return model(ids).logits
    base = logits(fields)
    for name, value in perturb.items():
        changed = copy.deepcopy(fields)
        if name == "rope_theta":
            changed["rope_parameters"]["rope_theta"] = value
        else:
            changed[name] = value
        assert float((logits(changed) - base).abs().max()) > 1e-4, name
