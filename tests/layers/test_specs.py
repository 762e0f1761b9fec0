"""build_decoder_block_spec: Megatron's block spec (moe_layer_freq, PP slicing) with only
the MoE MLP slots swapped for the variant's layer, shared spec objects untouched, Megatron
0.19.2's builder form kept (TransformerLayer hands pg_collection to every MLP builder, so
none may carry it in its params), SP-capable norms on CPU."""

import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.torch_norm import WrappedTorchNorm

from megatron_mvmoe.layers.builders import is_builder, module_of, parts
from megatron_mvmoe.layers.latent_moe import LatentMoELayer
from megatron_mvmoe.layers.multi_view_moe import MultiViewMoELayer
from megatron_mvmoe.layers.norm import SequenceParallelTorchNorm
from megatron_mvmoe.models.specs import build_decoder_block_spec
from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
from megatron_mvmoe.routing.router import MultiRouter
from megatron_mvmoe.testing.spawn import run_distributed

from layer_utils import mv_config

PATTERN = [1, 0, 1, 1]
EXPECTED = {"smoe": MoELayer, "latent": LatentMoELayer, "multi_router": LatentMoELayer,
            "multi_view": MultiViewMoELayer}


def _mlp_modules(block):
    return [module_of(spec.submodules.mlp) for spec in block.layer_specs]


def _spec_worker(rank, world_size, pp):
    pgs = initialize_layout(ParallelLayout(pp=pp))
    out = {}
    for variant in EXPECTED:
        config = mv_config(variant, num_routers=2, num_layers=4, moe_layer_freq=PATTERN,
                           pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
        stock = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        stock_mlps = [spec.submodules.mlp for spec in stock.layer_specs]
        block = build_decoder_block_spec(config)
        mlps = [spec.submodules.mlp for spec in block.layer_specs]
        out[variant] = {
            "modules": [module_of(m) for m in mlps],
            "routers": [getattr(parts(m).submodules, "router", None) for m in mlps],
            "builder_form_kept": [is_builder(m) == is_builder(stock)
                                  and "pg_collection" not in parts(m).params
                                  for m, stock in zip(mlps, stock_mlps)],
            "stock_untouched": [module_of(m) for m in stock_mlps] == [
                module_of(m) for m in [s.submodules.mlp for s in gpt_layer_specs
                                   .get_gpt_decoder_block_spec(config, False).layer_specs]],
        }
    sp = mv_config("multi_view", num_routers=2, num_layers=4, tensor_model_parallel_size=2,
                   sequence_parallel=True)
    block = build_decoder_block_spec(sp)
    out["sp_norms"] = [block.layer_norm] + [s.submodules.input_layernorm
                                            for s in block.layer_specs]
    return out


@pytest.mark.parametrize("pp", [1, 2])
def test_only_moe_slots_swapped_and_pp_sliced(pp):
    results = run_distributed(_spec_worker, pp, args=(pp,))
    for stage, res in enumerate(results):
        pattern = PATTERN[stage * 4 // pp:(stage + 1) * 4 // pp]
        for variant, layer_cls in EXPECTED.items():
            r = res[variant]
            assert len(r["modules"]) == len(pattern)
            for is_moe, module, router, form_kept in zip(pattern, r["modules"], r["routers"],
                                                          r["builder_form_kept"]):
                assert form_kept, (variant, module)
                if not is_moe:
                    assert not issubclass(module, MoELayer)
                    continue
                assert module is layer_cls, (variant, module)
                if variant in ("multi_router", "multi_view"):
                    assert router is MultiRouter
            assert r["stock_untouched"]
        assert all(norm is SequenceParallelTorchNorm for norm in res["sp_norms"])
        assert WrappedTorchNorm not in res["sp_norms"]


def _misc_worker(rank, world_size):
    initialize_layout(ParallelLayout())
    out = {}
    try:
        block = build_decoder_block_spec(mv_config("mh_moe", num_routers=1, latent_size=None))
        out["mh_moe"] = _mlp_modules(block)
    except NotImplementedError as exc:
        out["mh_moe"] = str(exc)
    dense = mv_config("dense", num_routers=1, num_moe_experts=None, moe_ffn_hidden_size=None,
                      moe_router_enable_expert_bias=False, moe_router_topk=2,
                      moe_router_score_function="softmax", latent_size=None)
    out["dense"] = _mlp_modules(build_decoder_block_spec(dense))
    return out


def test_mh_moe_slot_and_dense_variant():
    out = run_distributed(_misc_worker, 1)[0]
    if isinstance(out["mh_moe"], str):  # MH-MoE layer not available: a clear error
        assert "mh_moe" in out["mh_moe"]
    else:
        assert all(m.__name__ == "MultiHeadMoELayer" for m in out["mh_moe"])
    assert not any(issubclass(m, MoELayer) for m in out["dense"])
