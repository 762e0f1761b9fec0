"""Model provider: the run's ModelSection + layout -> MVMoETransformerConfig -> GPTModel chunks.

Design choices:
- The decoder block comes from our spec builder (`models/specs.py`,
  `build_decoder_block_spec(config, vp_stage)`) which swaps only the MoE MLP
  slots of Megatron's own block spec.
- One GPTModel per virtual pipeline chunk, each knowing whether it holds the embedding
  (pre_process) or the LM head (post_process) from Megatron's own stage helpers, asked of
  the pipeline group in the caller's pg_collection (never Megatron's parallel_state).
- The one translation of our model config into Megatron's: shape fields map to Megatron's
  names, the nested MultiViewConfig / MultiHeadConfig / BitNetConfig are handed over as
  they are, `extra` (Megatron fields we do not model) goes on top.
- Multi-token prediction: GPTModel's own MTP block, its layers copied from the stage's last
  decoder layer (so built with the variant's MoE layer; models/mtp_spec.py).
- Fast paths (TE specs, grouped GEMM, fusions, flash attention, overlapped DDP) come from
  `models/fast_paths.py` for the target machine: on a GPU with TE they are on, on CPU the
  local equivalents run; `tools/plan.py --fast-paths` prints the same decisions. Dropout is
  off everywhere (the CUDA RNG tracker cannot fork on CPU; the seeds' recipes use none).
- Routing defaults per variant are the variant record's (config/variants.py
  `routing_defaults`): smoe and mh_moe use softmax top-k with a small aux loss (the classic
  SMoE); latent / multi_router / multi_view use sigmoid scores with the aux-loss-free expert
  bias (seed 000); the alltoall dispatcher everywhere.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional

import torch
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel.utils import (is_pp_first_stage, is_pp_last_stage,
                                                  is_vp_first_stage, is_vp_last_stage)
from megatron.core.transformer.enums import AttnBackend

from megatron_mvmoe.config.mla_config import megatron_config_class
from megatron_mvmoe.config.model_section import (ModelSection, model_section_from_dict,
                                                  sdpa_blocker)
from megatron_mvmoe.config.transformer_config import MVMoETransformerConfig
from megatron_mvmoe.errors import require
from megatron_mvmoe.models.fast_paths import (FastPath, Target, choose_fast_paths,
                                              config_fields, expert_matrix_elements,
                                              run_switches_off, swiglu_calls)
from megatron_mvmoe.models.mtp_spec import build_mtp_block_spec
from megatron_mvmoe.models.specs import build_decoder_block_spec
from megatron_mvmoe.parallel import ParallelLayout, check_layer_layout



def _numerics(use_bf16: bool, on_cpu: bool, use_fp16: bool = False) -> Dict[str, Any]:
    dtype = torch.bfloat16 if use_bf16 else torch.float16 if use_fp16 else torch.float32
    return dict(
        bf16=use_bf16, fp16=use_fp16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=on_cpu, perform_initialization=True,
        persist_layer_norm=False,  # apex-only
        hidden_dropout=0.0, attention_dropout=0.0,
    )


def target_for(on_cpu: bool, model: Optional[ModelSection] = None) -> Target:
    """The machine a config is built for: the CPU, or this process's GPU (and its TE). On
    CPU inductor is probed for `model` only when the fusion rule reaches the question (its
    SwiGLU call is big enough: `Target.probe_inductor`)."""
    if not on_cpu:
        return Target.here()
    return Target.cpu(probe_inductor=model is not None)


def model_fast_paths(model: ModelSection, target: Target, etp: int = 1,
                     optimizer=None) -> List[FastPath]:
    """Every fast-path decision for `model` on `target` (models/fast_paths.py), from the
    model's own fields and the run's OptimizerSection (None: the defaults, distributed
    optimizer, no Megatron-FSDP): the config's (transformer_config) and the banner's
    (training/build.py run_fast_paths) are one decision."""
    return choose_fast_paths(
        target, model.moe_variant, bitnet=model.bitnet.enabled,
        distributed_optimizer=optimizer is None or optimizer.use_distributed_optimizer,
        expert_elements=expert_matrix_elements(model, etp),
        attention_backend=model.attention_backend, sdpa_blocker=sdpa_blocker(model.extra),
        swiglu_fusion=model.bias_swiglu_fusion, swiglu_size=swiglu_calls(model, etp),
        run_off=run_switches_off(model, optimizer))


def _routing(model: ModelSection) -> Dict[str, Any]:
    if not model.is_moe:
        return {}
    common = dict(num_moe_experts=model.num_experts, moe_ffn_hidden_size=model.moe_ffn_hidden_size,
                  moe_router_topk=model.moe_router_topk, moe_token_dispatcher_type="alltoall",
                  moe_router_dtype="fp32",
                  moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size)
    return dict(common, **model.variant.routing_defaults)  # config/variants.py


def _activation(model: ModelSection):
    if model.swiglu:
        return torch.nn.functional.silu
    return quick_gelu if model.quick_geglu else torch.nn.functional.gelu


def architecture_fields(model: ModelSection) -> Dict[str, Any]:
    """The TransformerConfig fields of the model's architecture switches, as Megatron-LM's
    arguments.py sets them: --swiglu is a gated silu, --quick-geglu a gated quick_gelu,
    neither GeLU; biased linears bias the QKV projection too (`add_qkv_bias`, which
    --add-qkv-bias in `extra` can set alone)."""
    return dict(normalization=model.normalization, gated_linear_unit=model.gated_mlp,
                activation_func=_activation(model), add_bias_linear=model.add_bias_linear,
                add_qkv_bias=model.add_bias_linear)


def _pipeline_p2p(vpp: Optional[int]) -> Dict[str, bool]:
    """Megatron-LM's pipeline send/receive: the interleaved schedule overlaps them with
    compute (its --no-overlap-p2p-communication default), else one batched call
    (argument_utils: batch_p2p_comm = not overlap_p2p_comm). Batched at PP 2 with virtual
    stages is what Megatron-LM's validate_args refuses (two sends and receives between the
    same two ranks in one batch)."""
    return dict(overlap_p2p_comm=vpp is not None, batch_p2p_comm=vpp is None)


def transformer_config(model: ModelSection, tp: int = 1, pp: int = 1, ep: int = 1,
                       etp: int = 1, vpp: Optional[int] = None, use_bf16: bool = False,
                       on_cpu: bool = True, cp: int = 1, use_fp16: bool = False,
                       pp_layout: Optional[str] = None,
                       optimizer=None) -> MVMoETransformerConfig:
    """The full Megatron config of the model `shape` for one layout, with the fast paths
    the target machine (the CPU, or this process's GPU) takes for the run's `optimizer`
    section (model_fast_paths)."""
    kwargs: Dict[str, Any] = dict(
        num_layers=model.num_layers, hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads, num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size, init_method_std=0.02,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep,
        pipeline_model_parallel_layout=pp_layout,
        expert_tensor_parallel_size=etp, sequence_parallel=tp > 1,
        context_parallel_size=cp, **_pipeline_p2p(vpp),
        moe_variant=model.moe_variant, latent_size=model.latent_size,
        moe_dispatcher=model.moe_dispatcher,
        moe_dispatch_ranks_per_node=model.moe_dispatch_ranks_per_node,
        # copies: a Megatron config must not share mutable parts with the run config
        multi_view=dataclasses.replace(model.multi_view),
        multi_head=dataclasses.replace(model.multi_head),
        bitnet=dataclasses.replace(model.bitnet),
    )
    kwargs.update(architecture_fields(model))
    kwargs.update(_numerics(use_bf16, on_cpu, use_fp16))
    target = target_for(on_cpu, model)
    kwargs.update(config_fields(model_fast_paths(model, target, etp, optimizer)))
    if target.te:  # Megatron-LM's meaning: it picks TE's kernel (LanguageModule env vars)
        kwargs["attention_backend"] = AttnBackend[model.attention_backend]
    kwargs.update(_routing(model))
    kwargs.update(model.extra)
    if pp_layout is not None:  # Megatron's own checks assert; these name the flag
        check_layer_layout(ParallelLayout(pp=pp, vpp=vpp, pp_layout=pp_layout),
                           model.num_layers, kwargs.get("mtp_num_layers") or 0)
    config_class = megatron_config_class(kwargs)  # MLA's config with multi_latent_attention
    if config_class is not MVMoETransformerConfig:
        kwargs["rotary_base"] = model.rotary_base  # MLA's own RoPE (GPTModel builds none)
    return config_class(**kwargs)


def decoder_block_spec(config: MVMoETransformerConfig, vp_stage: Optional[int] = None):
    """This stage's decoder block spec (models/specs.py: Megatron's, MoE slots swapped)."""
    return build_decoder_block_spec(config, vp_stage=vp_stage)


def _stage_flags(vp_stage: Optional[int], pp_group, vp_size: Optional[int]) -> Dict[str, bool]:
    """Whether this chunk holds the embedding / the LM head: the first / last virtual stage
    on the first / last pipeline rank."""
    return dict(
        pre_process=is_vp_first_stage(vp_stage, vp_size) and is_pp_first_stage(pp_group),
        post_process=is_vp_last_stage(vp_stage, vp_size) and is_pp_last_stage(pp_group))


def build_gpt_chunk(config: MVMoETransformerConfig, model: ModelSection, pg_collection=None,
                    vp_stage: Optional[int] = None, pre_process: bool = True,
                    post_process: bool = True) -> GPTModel:
    """One GPTModel holding this stage's layers (the model's position embedding and
    embedding tying), and on the last stage the MTP block when `config.mtp_num_layers` is
    set (models/mtp_spec.py)."""
    block = decoder_block_spec(config, vp_stage)
    tied = not model.untie_embeddings_and_output_weights
    return GPTModel(config=config, transformer_layer_spec=block,
                    mtp_block_spec=build_mtp_block_spec(config, block, vp_stage),
                    vocab_size=model.vocab_size,
                    max_sequence_length=model.max_position_embeddings or model.seq_length,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=tied,
                    position_embedding_type=model.position_embedding_type,
                    rotary_base=model.rotary_base,
                    pg_collection=pg_collection, vp_stage=vp_stage)


def build_model_chunks(config: MVMoETransformerConfig, model: ModelSection,
                       pg_collection) -> List[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), on `pg_collection`'s groups."""
    vpp = config.virtual_pipeline_model_parallel_size
    stages = range(vpp) if vpp else [None]
    return [build_gpt_chunk(config, model, pg_collection, vp_stage=stage,
                            **_stage_flags(stage, pg_collection.pp, vpp))
            for stage in stages]


def count_parameters(chunks: List[torch.nn.Module]) -> int:
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())


def fields_config(model_fields: Mapping[str, Any], **overrides: Any) -> MVMoETransformerConfig:
    """The Megatron config of a run config's model mapping (e.g. a seed-2 preset's
    `model_fields()`) on one CPU rank, as the trainer builds it; `overrides` then replace
    Megatron config fields and the variant's requirements are checked again."""
    config = transformer_config(model_section_from_dict(model_fields))
    for name, value in overrides.items():
        setattr(config, name, value)
    config.validate_mvmoe()
    return config
