"""The one typed model config: presets resolved at load, our configs nested, `extra` only for
Megatron fields, earlier spellings (run_state.json of older checkpoints) still read."""

import dataclasses

import pytest

from megatron_mvmoe.checkpointing.fingerprint import model_fingerprint
from megatron_mvmoe.config.model_section import ModelSection, model_section_from_dict
from megatron_mvmoe.config.run_config import config_from_dict, saved_config_from_dict
from megatron_mvmoe.config.transformer_config import MultiHeadConfig, MultiViewConfig
from megatron_mvmoe.models.build import validate_run


def test_preset_resolved_at_load_with_nested_overrides():
    model = model_section_from_dict({"preset": "tiny_multi_view",
                                     "multi_view": {"gamma_ramp_steps": 7}})
    assert isinstance(model.multi_view, MultiViewConfig)
    # the preset's R = K = 2 survive a nested override of one field
    assert (model.multi_view.num_routers, model.multi_view.num_views,
            model.multi_view.gamma_ramp_steps) == (2, 2, 7)
    assert model.latent_size == 32 and model.hidden_size == 64


def test_loading_is_idempotent():
    """to_dict() of a loaded config loads back to the same config (what run dirs store)."""
    run = config_from_dict({"model": {"preset": "tiny_mh_moe", "bitnet": {"enabled": True}}})
    assert config_from_dict(run.to_dict()) == run


def test_nested_fields_are_type_checked_by_name():
    with pytest.raises(ValueError, match=r"^model\.multi_view\.num_routers: expected an integer"):
        model_section_from_dict({"preset": "tiny_multi_view", "multi_view": {"num_routers": "2"}})
    with pytest.raises(ValueError, match=r"model\.multi_head: unknown field\(s\) \['heads'\]"):
        model_section_from_dict({"preset": "tiny_mh_moe", "multi_head": {"heads": 2}})


def test_extra_refuses_fields_the_section_models():
    with pytest.raises(ValueError, match=r"model\.extra: \['latent_size', 'num_moe_experts'\] "
                                         r"are modelled .*Fix: set model\.latent_size, "
                                         r"model\.num_experts instead"):
        model_section_from_dict({"preset": "tiny_multi_view",
                                 "extra": {"num_moe_experts": 8, "latent_size": 16}})


def test_earlier_spellings_move_to_their_nested_place():
    """How run_state.json of earlier versions stores a model: flat R/K/H/switches, BitNet as
    a bool, and our configs inside `extra` (plain dicts after JSON)."""
    old = {"preset": "tiny_multi_view", "num_routers": 2, "num_views": 2,
           "gamma_ramp_steps": 5, "stop_grad_mixing": True, "gate_scale": None,
           "learned_gate_scale": None, "multi_view_kernels": "reference", "bitnet": True,
           "num_heads_mh": None, "extra": {"moe_aux_loss_coeff": 0.0}}
    model = saved_config_from_dict({"model": old, "training": {"no_longer_a_field": 1}}).model
    assert (model.multi_view.gamma_ramp_steps, model.multi_view.stop_grad_mixing,
            model.multi_view.kernels, model.bitnet.enabled) == (5, True, "reference", True)
    assert model.extra == {"moe_aux_loss_coeff": 0.0}
    suite_b = {"moe_variant": "mh_moe", "num_layers": 2, "hidden_size": 96,
               "num_attention_heads": 4, "ffn_hidden_size": 256, "vocab_size": 512,
               "seq_length": 32, "num_experts": 4, "moe_router_topk": 2, "num_heads_mh": 2,
               "extra": {"multi_head": dataclasses.asdict(MultiHeadConfig(
                   num_heads=2, merge_projection=False)), "moe_layer_freq": 2}}
    model = model_section_from_dict(suite_b)
    assert model.multi_head == MultiHeadConfig(num_heads=2, merge_projection=False)
    assert model.extra == {"moe_layer_freq": 2}


def test_fingerprint_keeps_the_flat_form_of_earlier_checkpoints():
    """A checkpoint written before the nesting recorded R, K and H flat; the same model
    must give the same fingerprint now, and a structural switch must change it."""
    model = model_section_from_dict({"preset": "tiny_multi_view"})
    printed = model_fingerprint(model)
    assert (printed["num_routers"], printed["num_views"], printed["num_heads_mh"]) == (2, 2, 1)
    assert not {"multi_view", "multi_head", "bitnet", "preset", "seq_length"} & set(printed)
    # not recorded as they are: the attention backend and the fusion switches hold no
    # weights; a learned table's rows enter as position_table_rows, and only when they differ
    # from seq_length
    assert set(printed) == {f.name for f in dataclasses.fields(ModelSection)} - {
        "preset", "seq_length", "multi_view", "multi_head", "bitnet", "attention_backend",
        "max_position_embeddings", "bias_swiglu_fusion", "apply_rope_fusion",
        "masked_softmax_fusion", "bias_dropout_fusion", "gradient_accumulation_fusion",
        "moe_permute_fusion", "moe_router_fusion"} | {"num_routers", "num_views",
                                                      "num_heads_mh"}
    no_merge = dataclasses.replace(model, multi_head=MultiHeadConfig(merge_projection=False))
    assert model_fingerprint(no_merge)["multi_head"]["merge_projection"] is False


NOT_COMPARED_CHANGES = {
    "multi_view": dict(gamma_ramp_steps=99, stop_grad_mixing=True, gate_scale=2.5,
                       view_init_std=0.5, normalizer_eps=1e-3, kernels="reference"),
    "bitnet": dict(activation_bits=4, input_norm=False),
}
"""Every subfield of the nested sections that holds no weights of its own, changed."""


@pytest.mark.parametrize("section,field", [(s, f) for s, changes in NOT_COMPARED_CHANGES.items()
                                           for f in changes])
def test_fingerprint_ignores_every_field_without_weights(section, field):
    """Each non-structural subfield alone leaves the fingerprint as it was; each of
    multi_view's structural ones (R, K, learned alpha) changes it."""
    model = model_section_from_dict({"preset": "tiny_multi_view", "bitnet": {"enabled": True}})
    printed = model_fingerprint(model)
    nested = dataclasses.replace(getattr(model, section),
                                 **{field: NOT_COMPARED_CHANGES[section][field]})
    assert model_fingerprint(dataclasses.replace(model, **{section: nested})) == printed


@pytest.mark.parametrize("field,value", [("num_routers", 4), ("num_views", 4),
                                         ("learned_gate_scale", True)])
def test_fingerprint_changes_with_every_structural_view_field(field, value):
    model = model_section_from_dict({"preset": "tiny_multi_view"})
    changed = dataclasses.replace(model.multi_view, **{field: value})
    assert model_fingerprint(dataclasses.replace(model, multi_view=changed)) != (
        model_fingerprint(model))


def test_every_non_structural_subfield_is_exercised():
    """The two tests above cover every subfield of MultiViewConfig and BitNetConfig."""
    from megatron_mvmoe.config.transformer_config import BitNetConfig

    structural = {"num_routers", "num_views", "learned_gate_scale", "enabled"}
    covered = structural | {f for changes in NOT_COMPARED_CHANGES.values() for f in changes}
    every = {f.name for c in (MultiViewConfig, BitNetConfig) for f in dataclasses.fields(c)}
    assert every == covered, every ^ covered


def test_a_model_invalid_for_its_variant_fails_at_validate_run():
    run = config_from_dict({"model": {"preset": "tiny_smoe", "moe_variant": "multi_view"}})
    with pytest.raises(ValueError, match=r"^model\.latent_size: variant multi_view needs a positive"):
        validate_run(run)


def test_megatron_config_errors_name_the_run_config_field():
    run = config_from_dict({"model": {"preset": "tiny_smoe", "moe_router_topk": 9}})
    with pytest.raises(ValueError, match=r"^model\.moe_router_topk: top-k 9 must be in "):
        validate_run(run)
    run = config_from_dict({"model": {"preset": "tiny_multi_view",
                                      "extra": {"moe_token_dispatcher_type": "allgather"}}})
    with pytest.raises(ValueError, match=r"^model\.extra\.moe_token_dispatcher_type: "):
        validate_run(run)


def test_checkpoints_older_than_a_fingerprint_field_still_match():
    """0.16.1-era checkpoints carry no rotary_base: they were built with RoPE base 10000
    (tools/resume_from_0161.sh found this); another base still fails."""
    from megatron_mvmoe.checkpointing.errors import CheckpointError
    from megatron_mvmoe.checkpointing.fingerprint import check_fingerprint

    current = model_fingerprint(model_section_from_dict({"preset": "tiny_multi_view"}))
    old = {k: v for k, v in current.items() if k != "rotary_base"}
    check_fingerprint(old, current, "ckpt")
    with pytest.raises(CheckpointError, match=r"rotary_base: checkpoint 10000 vs this run 500000"):
        check_fingerprint(old, dict(current, rotary_base=500000), "ckpt")


def test_extra_cannot_override_the_sections_own_fields():
    with pytest.raises(ValueError, match=r"model\.extra: \['hidden_size'\] .*model\.hidden_size"):
        model_section_from_dict({"preset": "tiny_smoe", "extra": {"hidden_size": 128}})
