"""The parity calculator's whole-model parameter count equals a real GPTModel built from the
tiny presets (Megatron's decoder-block spec, MoE slots swapped for MH-MoE)."""
import pytest
import torch

from megatron_mvmoe.config.seed2_presets import get_preset
from megatron_mvmoe.functional.parity_model import model_params
from megatron_mvmoe.models.provider import fields_config
from megatron_mvmoe.testing.spawn import run_distributed

CPU = dict(use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
           masked_softmax_fusion=False, apply_rope_fusion=False,
           gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
           persist_layer_norm=False, moe_grouped_gemm=False)


def _block_spec(config, pg):
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_local_spec)
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from megatron_mvmoe.layers.builders import module_of
    from megatron_mvmoe.layers.multi_head_moe import mh_moe_spec
    if config.num_moe_experts is None:
        return get_gpt_layer_local_spec(normalization="RMSNorm")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                       normalization="RMSNorm")
    if config.moe_variant == "mh_moe":
        for layer in block.layer_specs:
            if module_of(layer.submodules.mlp) is MoELayer:
                layer.submodules.mlp = mh_moe_spec(config)
    return block


def _count(rank, world_size, names):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
    pg = initialize_layout(ParallelLayout())
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    counts = {}
    for name in names:
        preset = get_preset(name, "tiny")
        config = fields_config(preset.model_fields(), **CPU)
        model = GPTModel(config=config, transformer_layer_spec=_block_spec(config, pg),
                         vocab_size=preset.model.vocab_size, position_embedding_type="rope",
                         max_sequence_length=preset.model.seq_length, pg_collection=pg)
        counts[name] = sum(p.numel() for p in model.parameters())
        tokens = torch.randint(0, preset.model.vocab_size, (1, 16))
        model(tokens, torch.arange(16)[None], None, labels=tokens).mean().backward()
    return counts


def test_analytic_params_equal_gpt_model():
    names = ["dense", "smoe_shared", "mh_moe_h3", "mh_moe_h2_head_only"]
    counts = run_distributed(_count, 1, timeout_s=240, args=(names,))[0]
    for name in names:
        assert counts[name] == model_params(get_preset(name, "tiny").model)["total"], name
