"""The variant records' costs (config/variants.py) against naive references: per variant,
the record's MoE-layer parameters equal a hand count AND the parameters of the layer the
trainer builds (models/specs.build_moe_layer through provider.transformer_config); FLOPs and
all-to-all bytes per token equal their hand formulas; the records' builders are callables,
their dispatchers and HF structures known names."""

import dataclasses

import pytest

from megatron_mvmoe.config.model_section import model_from_preset
from megatron_mvmoe.config.dispatchers import DISPATCHER_NAMES
from megatron_mvmoe.config.variants import VARIANTS, MoEDims, get_variant
from megatron_mvmoe.testing.spawn import run_distributed

D, L, E, F, k, S, R, H = 64, 16, 8, 32, 2, 24, 3, 4
DIMS = MoEDims(hidden=D, experts=E, expert_ffn=F, topk=k, shared_ffn=S, latent=L, routers=R,
               views=R, heads=H)


def naive_params(variant: str, dims: MoEDims = DIMS):
    """(total, active) of one MoE layer, written out per variant from the layer's modules:
    experts and shared expert are SwiGLU (fc1 [2F, in] + fc2 [in, F])."""
    shared = 3 * D * S
    if variant == "smoe":
        router, proj, expert, slots = E * D, 0, 3 * D * F, k
    elif variant == "latent":  # Megatron's TopKRouter on h; down P [L, D] and up [D, L]
        router, proj, expert, slots = E * D, 2 * L * D, 3 * L * F, k
    elif variant == "multi_router":  # R router heads
        router, proj, expert, slots = R * E * D, 2 * L * D, 3 * L * F, k
    elif variant == "multi_view":  # R heads and R - 1 view perturbations dP_m [L, D]
        router, proj, expert, slots = R * E * D, 2 * L * D + (R - 1) * L * D, 3 * L * F, k
    elif variant == "mh_moe":  # head + merge [D, D]; router and experts on D / H
        proj = (dims.head_projection + dims.merge_projection) * D * D
        router, expert, slots = E * D // H, 3 * (D // H) * F, H * k
    return (router + proj + shared + E * expert, router + proj + shared + slots * expert,
            router)


ROUTED = [name for name, v in VARIANTS.items() if v.routed_experts]


@pytest.mark.parametrize("variant", ROUTED)
def test_layer_params_and_flops_equal_the_hand_count(variant):
    record = get_variant(variant)
    total, active, router = naive_params(variant)
    params = record.layer_params(DIMS)
    assert (params.total, params.active) == (total, active)
    assert record.matmul_flops_per_token(DIMS) == 2 * active
    assert record.leading_flops_per_token(DIMS) == 2 * (active - router)
    assert record.mixing_flops_per_token(DIMS) == (2 * k * R * L if variant == "multi_view"
                                                   else 0)
    width = {"smoe": D, "mh_moe": D // H}.get(variant, L)
    rows = H * k if variant == "mh_moe" else k
    assert record.a2a_bytes_per_token(DIMS, dtype_bytes=2) == rows * width * 2


def test_mh_moe_counts_only_the_projections_it_builds():
    for head, merge in ((True, False), (False, True), (False, False)):
        dims = dataclasses.replace(DIMS, head_projection=head, merge_projection=merge)
        assert get_variant("mh_moe").layer_params(dims).total == naive_params("mh_moe",
                                                                               dims)[0]


def test_mh_moe_and_smoe_are_the_parity_shapes():
    """SMoE and MH-MoE leading FLOPs are seed 001's Eq. 6-7: 2 (P D^2 + H k m (D/H) F + m D S)."""
    assert get_variant("smoe").leading_flops_per_token(DIMS) == 2 * (k * 3 * D * F + 3 * D * S)
    assert get_variant("mh_moe").leading_flops_per_token(DIMS) == 2 * (
        2 * D * D + H * k * 3 * (D // H) * F + 3 * D * S)


def test_records_carry_builders_known_dispatchers_and_dense_has_no_costs():
    for record in VARIANTS.values():
        assert record.moe_layer is None or callable(record.moe_layer)
        assert (record.moe_layer is None) == (record.name in ("dense", "smoe")), record.name
        assert set(record.dispatchers) <= set(DISPATCHER_NAMES), record.name
    with pytest.raises(ValueError, match="moe_variant: 'dense' has no MoE layer"):
        get_variant("dense").layer_params(DIMS)
    with pytest.raises(ValueError, match="Variant.hf_structure: unknown 'mlp'"):
        dataclasses.replace(get_variant("smoe"), hf_structure="mlp")


def test_head_counts_give_each_variant_its_heads():
    assert get_variant("latent").head_counts(2) == {"num_routers": 1, "num_views": 1,
                                                    "num_heads": 1}
    assert get_variant("multi_router").head_counts(2)["num_views"] == 1
    assert get_variant("multi_view").head_counts(2) == {"num_routers": 2, "num_views": 2,
                                                        "num_heads": 1}
    assert get_variant("mh_moe").head_counts(2)["num_heads"] == 2


TINY = {"smoe": "tiny_smoe", "latent": "tiny_latent", "multi_router": "tiny_multi_router",
        "multi_view": "tiny_multi_view", "mh_moe": "tiny_mh_moe",
        "mh_moe_no_proj": "seed2_tiny_mh_moe_h2_no_proj",
        "mh_moe_head_only": "seed2_tiny_mh_moe_h2_head_only"}
"""Every routed variant, and MH-MoE without its merge / both projections (Table 4/5
ablations: the record counts only the projections the layer builds)."""


def _built_layer_params(rank, world_size, presets):
    from megatron_mvmoe.models.provider import transformer_config
    from megatron_mvmoe.models.specs import build_moe_layer
    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout

    pgs = initialize_layout(ParallelLayout())
    out = {}
    for name, preset in presets.items():
        section = model_from_preset(preset, num_layers=1)
        layer = build_moe_layer(transformer_config(section), pgs)
        out[name] = sum(p.numel() for p in layer.parameters())
    return out


def test_record_counts_equal_the_built_layers():
    built = run_distributed(_built_layer_params, 1, timeout_s=240, args=(TINY,))[0]
    for name, preset in TINY.items():
        section = model_from_preset(preset)
        assert section.variant.layer_params(MoEDims.of(section)).total == built[name], name


@pytest.mark.parametrize("variant", ROUTED)
def test_analytic_alltoall_rows_are_the_records_bytes(variant):
    """analysis/a2a/analytic.py (tools/a2a_volume.py) and the planner count the same bytes."""
    from megatron_mvmoe.analysis.a2a.analytic import CommShape, dispatch_bytes

    tokens = 12
    shape = CommShape(tokens=tokens, hidden=D, topk=k, latent=L, heads=H, dtype_bytes=2)
    assert dispatch_bytes(variant, "alltoall", shape).tokens_in == \
        tokens * get_variant(variant).a2a_bytes_per_token(DIMS, dtype_bytes=2)
