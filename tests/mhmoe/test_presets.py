"""Seed-2 presets: paper configurations, parity within the stated tolerance, configs build."""
import pytest

from megatron_mvmoe.config.seed2_presets import all_presets, family_names, get_preset
from megatron_mvmoe.functional.parity import FLOPS_TOLERANCE, PARAMS_TOLERANCE, layer_params
from megatron_mvmoe.functional.parity_model import model_params, parity_row
from megatron_mvmoe.models.provider import fields_config

SIZES = ("paper", "tiny")


def _row(preset, size):
    reference = get_preset(preset.reference, size).model if preset.reference else None
    return parity_row(preset.name, preset.model, reference, preset.matched)


@pytest.mark.parametrize("size", SIZES)
def test_matched_presets_within_tolerance(size):
    matched = [p for p in all_presets(size) if p.matched]
    assert len(matched) == 8  # smoe, fine-grained, h2, h3, each with and without shared
    for preset in matched:
        row = _row(preset, size)
        assert abs(row["dev_layer_flops_pct"]) <= 100 * FLOPS_TOLERANCE, preset.name
        assert abs(row["dev_layer_params_pct"]) <= 100 * PARAMS_TOLERANCE, preset.name


@pytest.mark.parametrize("size", SIZES)
def test_ablations_are_flagged_unmatched_and_outside_tolerance(size):
    for name in ("smoe_head_merge", "mh_moe_h2_no_proj", "mh_moe_h2_head_only",
                 "mh_moe_h2_merge_only", "fine_grained_top1"):
        preset = get_preset(name, size)
        assert not preset.matched
        assert abs(_row(preset, size)["dev_layer_flops_pct"]) > 100 * FLOPS_TOLERANCE


def test_paper_numbers():
    expect = {"smoe": (8, 2048, 1, 1), "fine_grained": (16, 1024, 2, 1),
              "mh_moe_h2": (40, 768, 2, 2), "mh_moe_h3": (96, 512, 3, 3)}
    for name, (e, f, k, h) in expect.items():
        moe = get_preset(name).model.moe
        assert (moe.num_experts, moe.expert_ffn, moe.topk, moe.num_heads) == (e, f, k, h)
        assert get_preset(name + "_shared").model.moe.shared_expert_ffn == 2048
    model = get_preset("smoe").model
    assert (model.num_layers, model.hidden_size, model.num_moe_layers) == (12, 768, 6)


def test_tiny_keeps_ratios():
    for name in ("smoe", "fine_grained", "mh_moe_h2", "mh_moe_h3"):
        big, tiny = get_preset(name).model.moe, get_preset(name, "tiny").model.moe
        assert tiny.num_experts == big.num_experts and tiny.topk == big.topk
        assert tiny.expert_ffn * big.hidden_size == big.expert_ffn * tiny.hidden_size
    assert model_params(get_preset("mh_moe_h3", "tiny").model)["total"] < 3_000_000


def test_head_merge_ablation_switches():
    head_only = get_preset("mh_moe_h2_head_only").model.moe
    merge_only = get_preset("mh_moe_h2_merge_only").model.moe
    assert (head_only.head_projection, head_only.merge_projection) == (True, False)
    assert (merge_only.head_projection, merge_only.merge_projection) == (False, True)
    assert layer_params(head_only).projections == 768 * 768


def test_bad_names_and_sizes():
    with pytest.raises(ValueError, match="name"):
        get_preset("dense_shared")
    with pytest.raises(ValueError, match="size"):
        get_preset("smoe", size="huge")
    with pytest.raises(ValueError, match="multiple of 6"):
        get_preset("mh_moe_h3", hidden_size=64)


@pytest.mark.parametrize("name", family_names())
def test_tiny_configs_build(name):
    cfg = fields_config(get_preset(name, "tiny", bitnet=name == "mh_moe_h3").model_fields(),
                        use_cpu_initialization=True)
    moe = get_preset(name, "tiny").model.moe
    if moe is None:
        assert cfg.moe_variant == "dense" and cfg.num_moe_experts is None
        return
    assert (cfg.num_moe_experts, cfg.moe_ffn_hidden_size, cfg.moe_router_topk) == (
        moe.num_experts, moe.expert_ffn, moe.topk)
    assert cfg.moe_layer_freq == 2 and cfg.gated_linear_unit
    if cfg.moe_variant == "mh_moe":
        assert cfg.multi_head.num_heads == moe.num_heads
        assert cfg.multi_head.head_projection == moe.head_projection
