"""Decoder-block specs for every MoE variant: `build_decoder_block_spec`.

Design choices:
- Start from Megatron's own `get_gpt_decoder_block_spec` (it parses `moe_layer_freq` and
  slices the layers of this pipeline stage / virtual stage) and swap ONLY the MoE MLP slots
  for the variant's layer. Spec objects are shared between layers (and module-level in
  Megatron): every change builds new objects with `dataclasses.replace`, nothing is mutated.
- Variants: the record's `moe_layer` callable (config/variants.py) builds the slot; no
  table here. dense (no experts; Megatron's dense spec) and smoe (stock MoELayer) keep
  Megatron's slot; the shipped builders are below: latent (LatentMoELayer + Megatron's
  TopKRouter), multi_router (LatentMoELayer + MultiRouter), multi_view (MultiViewMoELayer +
  MultiRouter), mh_moe (`megatron_mvmoe.layers.multi_head_moe.mh_moe_spec(config)`).
- Megatron 0.19.2 describes MLP slots as builders (`functools.partial`), called by
  TransformerLayer with `config=, pg_collection=, is_mtp_layer=, name=` whatever the class:
  our layers receive their process groups from it like Megatron's own MoELayer does. Specs
  of either form are read and rebuilt through `layers/builders.py` only.
- Without TransformerEngine the local backend is used; its torch norm refuses sequence
  parallelism, so with SP on every `WrappedTorchNorm` slot becomes `SequenceParallelTorchNorm`,
  the attention's QK norms included (`--qk-layernorm`: q/k norms of standard attention see
  this rank's heads, MLA's q/kv latent norms this rank's sequence slice; either way the
  replicated weights' grads are partial sums that finalize_model_grads all-reduces over TP).
- Attention is Megatron's: standard attention or, with `config.multi_latent_attention`
  (config/mla_config.py), MLASelfAttention, both chosen by `get_gpt_decoder_block_spec`; on the
  local backend MLA is `LocalMLASelfAttention` with `MLADotProductAttention` (two fixes of
  Megatron's local MLA: its core attention cannot take MLA's head widths, and with TP > 1
  its RoPE-key gradient is never summed over TP; layers/local_mla.py). At CP > 1 the local
  core attention (standard or MLA's) becomes the all-gather CP attention
  (layers/cp_attention.py), which Megatron's local backend lacks.
- With `config.sdpa_attention` (the fast-path rule from model.attention_backend) the local
  core attention, MLA's and CP's included, runs on torch SDPA (layers/sdpa_attention.py):
  same constructor, parameters and checkpoints, only the forward differs.
- BitNet (`config.bitnet.enabled`): the finished block goes through `maybe_bitnet_spec`, so
  attention, dense MLPs, experts and shared experts use the Bit linears; our latent, view and
  MH-MoE head/merge projections quantize themselves from the config. Routers, embeddings and
  the output layer stay full precision (BitNet b1.58's recipe; the latter two are built by
  GPTModel, outside the block). Always the local backend (the Bit classes extend it).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_mvmoe.config.variants import get_variant
from megatron_mvmoe.errors import require
from megatron_mvmoe.layers.bitnet import maybe_bitnet_spec
from megatron_mvmoe.layers.builders import build, module_of, parts, rebuilt
from megatron_mvmoe.layers.cp_attention import CPDotProductAttention, CPMLADotProductAttention
from megatron_mvmoe.layers.grouped_experts import with_grouped_experts
from megatron_mvmoe.layers.latent_moe import LatentMoELayer
from megatron_mvmoe.layers.local_mla import LocalMLASelfAttention, MLADotProductAttention
from megatron_mvmoe.layers.multi_view_moe import MultiViewMoELayer
from megatron_mvmoe.layers.norm import SequenceParallelTorchNorm
from megatron_mvmoe.layers.sdpa_attention import CP_SDPA_OF, SDPA_OF

_LAYER_NORM_SLOTS = ("input_layernorm", "pre_cross_attn_layernorm", "pre_mlp_layernorm")
_ATTENTION_NORM_SLOTS = ("q_layernorm", "k_layernorm", "kv_layernorm")


def use_transformer_engine() -> bool:
    """TE specs when TransformerEngine is importable, else Megatron's local backend."""
    return bool(gpt_layer_specs.HAVE_TE)


def build_decoder_block_spec(config, vp_stage: Optional[int] = None,
                             use_te: Optional[bool] = None) -> TransformerBlockSubmodules:
    """This pipeline stage's decoder block spec for `config.moe_variant`. `config` was
    validated where it was built (MVMoETransformerConfig.__post_init__; a field set after
    that is checked by whoever sets it: models/provider.fields_config)."""
    use_te = _choose_te(config, use_te)
    _check_attention(config, use_te)
    block = gpt_layer_specs.get_gpt_decoder_block_spec(
        config, use_transformer_engine=use_te, vp_stage=vp_stage)
    layer_specs = [_swap_moe_slot(spec, config) for spec in block.layer_specs]
    block = replace(block, layer_specs=layer_specs)
    if config.sequence_parallel and not use_te:
        block = _sequence_parallel_norms(block)
    if getattr(config, "multi_latent_attention", False) and not use_te:
        block = _local_mla(block)
    if getattr(config, "sdpa_attention", False) and not use_te:
        block = _swap_attention_slots(block, ("core_attention",),
                                      lambda core: SDPA_OF.get(core, core))
    if config.context_parallel_size > 1 and not use_te:
        block = _swap_attention_slots(block, ("core_attention",), _context_parallel_core)
    return maybe_bitnet_spec(block, config)


def _context_parallel_core(core):
    """The local backend's core attention at CP > 1: Megatron's local DotProductAttention
    asserts CP == 1, so it becomes the all-gather CP attention (layers/cp_attention.py), MLA's
    included."""
    return {DotProductAttention: CPDotProductAttention,
            MLADotProductAttention: CPMLADotProductAttention, **CP_SDPA_OF}.get(core, core)


def _choose_te(config, use_te: Optional[bool]) -> bool:
    """TE when available, except under BitNet: the Bit linears extend Megatron's local
    Column/RowParallelLinear, so TE's fused linears would silently stay full precision."""
    if not _bitnet_enabled(config):
        return use_transformer_engine() if use_te is None else use_te
    require(not use_te, "bitnet.enabled",
            "BitNet quantizes Megatron's local linears; TransformerEngine layers would stay "
            "full precision", "build the block with use_te=False (or leave it None)")
    return False


def _check_attention(config, use_te: bool) -> None:
    """What Megatron's local MLA cannot build, refused before the build (its own error
    would come from deep inside MLASelfAttention)."""
    if not getattr(config, "multi_latent_attention", False):
        return
    require(use_te or not config.qk_layernorm or config.q_lora_rank is not None,
            "q_lora_rank", "--qk-layernorm with MLA and no q_lora_rank puts the query norm "
            "inside linear_q_proj, which only TransformerEngine's fused norm+linear does",
            "set --q-lora-rank (queries through a normalised latent) or drop --qk-layernorm")


def _bitnet_enabled(config) -> bool:
    bitnet = getattr(config, "bitnet", None)
    return bitnet is not None and bitnet.enabled


def moe_mlp_spec(config, moe_spec):
    """The MLP builder of an MoE slot for the variant, derived from Megatron's `moe_spec`
    (a builder or a ModuleSpec; the result has the same form)."""
    variant = get_variant(getattr(config, "moe_variant", "smoe"))
    moe_spec = with_grouped_experts(moe_spec, config)  # the CPU grouped-GEMM experts rule
    if variant.moe_layer is None:
        return moe_spec  # Megatron's own MoELayer and TopKRouter (smoe)
    return variant.moe_layer(config, moe_spec, variant)


def latent_layer(config, moe_spec, variant, layer=LatentMoELayer, router=None):
    """`layer` (LatentMoELayer) around `router` (None: Megatron's TopKRouter of the slot,
    sigmoid via the config)."""
    submodules = parts(moe_spec).submodules
    return rebuilt(moe_spec, module=layer,
                   submodules=replace(submodules, router=router or submodules.router))


def multi_router_layer(config, moe_spec, variant):
    from megatron_mvmoe.routing.router import MultiRouter

    return latent_layer(config, moe_spec, variant, router=MultiRouter)


def multi_view_layer(config, moe_spec, variant):
    from megatron_mvmoe.routing.router import MultiRouter

    return latent_layer(config, moe_spec, variant, layer=MultiViewMoELayer, router=MultiRouter)


def multi_head_layer(config, moe_spec, variant):
    from megatron_mvmoe.layers.multi_head_moe import mh_moe_spec

    return mh_moe_spec(config, moe_spec=moe_spec)


def build_moe_layer(config, pg_collection, layer_number: int = 1, use_te: bool = False):
    """The variant's MoE layer alone, built from the same builder the decoder block uses
    and called the way TransformerLayer calls it (tests, benchmarks; `use_te` for TE's
    grouped experts on a GPU)."""
    spec = moe_mlp_spec(config, stock_moe_spec(config, use_te=_choose_te(config, use_te)))
    spec = maybe_bitnet_spec(spec, config)
    layer = build(spec, config=config, pg_collection=pg_collection, is_mtp_layer=False)
    layer.set_layer_number(layer_number)
    return layer


def stock_moe_spec(config, use_te: bool = False):
    """Megatron's MoE builder for this config (no block around it)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    return get_moe_module_spec(use_te=use_te, num_experts=config.num_moe_experts,
                               moe_grouped_gemm=config.moe_grouped_gemm)


def _swap_moe_slot(layer_spec: ModuleSpec, config) -> ModuleSpec:
    mlp = getattr(layer_spec.submodules, "mlp", None)
    if mlp is None or module_of(mlp) is not MoELayer:
        return layer_spec
    new_mlp = moe_mlp_spec(config, mlp)
    if new_mlp is mlp:
        return layer_spec
    return replace(layer_spec, submodules=replace(layer_spec.submodules, mlp=new_mlp))


def _sequence_parallel_norms(block: TransformerBlockSubmodules) -> TransformerBlockSubmodules:
    """Every WrappedTorchNorm slot (block, layers, attention QK norms) ->
    SequenceParallelTorchNorm."""
    def swap(norm):
        return SequenceParallelTorchNorm if norm is WrappedTorchNorm else norm

    layer_specs = []
    for spec in block.layer_specs:
        changes = {slot: swap(getattr(spec.submodules, slot)) for slot in _LAYER_NORM_SLOTS
                   if hasattr(spec.submodules, slot)}
        layer_specs.append(replace(spec, submodules=replace(spec.submodules, **changes)))
    block = replace(block, layer_specs=layer_specs, layer_norm=swap(block.layer_norm))
    return _swap_attention_slots(block, _ATTENTION_NORM_SLOTS, swap)


def _local_mla(block: TransformerBlockSubmodules) -> TransformerBlockSubmodules:
    """MLA layers of the local backend: LocalMLASelfAttention with MLADotProductAttention
    (layers/local_mla.py: what Megatron's local MLA gets wrong and why)."""
    def swap(core):
        return MLADotProductAttention if core is DotProductAttention else core

    block = _swap_attention_slots(block, ("core_attention",), swap)
    layer_specs = [replace(spec, submodules=replace(spec.submodules, self_attention=replace(
        spec.submodules.self_attention, module=LocalMLASelfAttention)))
        if spec.submodules.self_attention.module is MLASelfAttention else spec
        for spec in block.layer_specs]
    return replace(block, layer_specs=layer_specs)


def _swap_attention_slots(block: TransformerBlockSubmodules, slots, swap):
    """Each layer's self-attention spec with `swap` applied to those of `slots` it has
    (new spec objects; Megatron's shared ones untouched)."""
    layer_specs = []
    for spec in block.layer_specs:
        attention = spec.submodules.self_attention
        submodules = getattr(attention, "submodules", None)
        if submodules is not None:
            changes = {slot: swap(getattr(submodules, slot)) for slot in slots
                       if hasattr(submodules, slot)}
            attention = replace(attention, submodules=replace(submodules, **changes))
        layer_specs.append(replace(spec, submodules=replace(spec.submodules,
                                                            self_attention=attention)))
    return replace(block, layer_specs=layer_specs)
