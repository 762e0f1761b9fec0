"""The model of a run: every dimension resolved, our model configs nested as they are.

Design choices:
- One typed model config, from YAML to the provider: `ModelSection` holds the shape
  (Megatron-LM's names), our own configs nested directly (`multi_view`: MultiViewConfig,
  `multi_head`: MultiHeadConfig, `bitnet`: BitNetConfig, the very objects
  MVMoETransformerConfig carries) and `extra`, which is only for Megatron
  TransformerConfig fields we do not model (e.g. moe_aux_loss_coeff, moe_layer_freq).
- A preset is resolved when the config is loaded (`model_section_from_dict`): the preset's
  values, then the YAML's / flags' (nested mappings merge key by key; null keeps the
  preset's value). So after loading, `run.model` IS the model; nothing downstream merges,
  translates or patches it again (models/provider.py maps it to Megatron's config once).
- Older spellings are read, never written: flat `num_routers`, `num_views`,
  `gamma_ramp_steps`, `stop_grad_mixing`, `gate_scale`, `learned_gate_scale`,
  `multi_view_kernels`, `num_heads_mh`, `bitnet: true` and our configs passed through
  `extra` (how run_state.json and config.yaml of earlier versions store them) move to their
  nested place, so every checkpoint written before still resumes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Dict, Literal, Mapping, Optional

from megatron_mvmoe.config.dispatchers import DEFAULT_DISPATCHER, DISPATCHER_NAMES
from megatron_mvmoe.config.presets import PRESETS, preset_names
from megatron_mvmoe.config.transformer_config import (BitNetConfig, MultiHeadConfig,
                                                      MultiViewConfig)
from megatron_mvmoe.config.typed_config import OneOf, dataclass_from_dict, deep_merge
from megatron_mvmoe.config.variants import VARIANTS, Variant, get_variant
from megatron_mvmoe.config.yarn import check_yarn
from megatron_mvmoe.errors import require

ATTENTION_BACKENDS = ("auto", "sdpa", "flash", "fused", "unfused", "local")
"""model.attention_backend values: Megatron-LM's --attention-backend choices and sdpa."""


def sdpa_blocker(megatron_fields: Mapping[str, Any]) -> str:
    """Why SDPA cannot serve a model whose Megatron config sets `megatron_fields` (a run's
    `model.extra`, or a TransformerConfig's fields); "" when it can."""
    if megatron_fields.get("window_size") is not None:
        return (f"window_size={megatron_fields['window_size']}: a sliding window is "
                "Megatron's masked softmax only")
    if megatron_fields.get("apply_query_key_layer_scaling"):
        return ("apply_query_key_layer_scaling: fp16's score scaling is Megatron's "
                "DotProductAttention only")
    softmax_type = megatron_fields.get("softmax_type", "vanilla")
    if softmax_type != "vanilla":
        return f"softmax_type={softmax_type!r}: a softmax offset is not in SDPA"
    return ""


@dataclass
class ModelSection:
    """The model: a preset name plus every resolved dimension and switch."""

    preset: Optional[str] = None
    """Name in megatron_mvmoe.config.presets.PRESETS this model started from (recorded)."""
    moe_variant: Optional[Annotated[str, OneOf(VARIANTS)]] = None
    """What the MLPs are (config/variants.py: dense, smoe, latent, multi_router, multi_view,
    mh_moe); the values are the variant registry's names."""
    moe_dispatcher: Literal[DISPATCHER_NAMES] = DEFAULT_DISPATCHER
    """The MoE layers' token dispatcher (config/dispatchers.py): alltoall (Megatron's rows,
    the default), dedup_rank / dedup_node (one copy per (token, destination rank / node))."""
    moe_dispatch_ranks_per_node: Optional[int] = None
    """EP ranks per node for moe_dispatcher=dedup_node (None: the EP group is one node)."""
    num_layers: Optional[int] = None
    """Transformer layers."""
    hidden_size: Optional[int] = None
    """D, the hidden size."""
    num_attention_heads: Optional[int] = None
    """Attention heads."""
    num_query_groups: Optional[int] = None
    """Grouped-query attention groups (None = one per head)."""
    ffn_hidden_size: Optional[int] = None
    """Dense MLP width (dense layers and the dense variant)."""
    num_experts: Optional[int] = None
    """E, routed experts per MoE layer."""
    moe_ffn_hidden_size: Optional[int] = None
    """Width of one routed expert."""
    moe_router_topk: Optional[int] = None
    """Experts per token (top-k)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Width of the always-active shared expert (None = no shared expert)."""
    latent_size: Optional[int] = None
    """L for latent / multi_router / multi_view."""
    vocab_size: Optional[int] = None
    """Padded vocabulary size (None = the tokenizer's, padded: Megatron-LM's rule)."""
    seq_length: Optional[int] = None
    """Sequence length in tokens."""
    max_position_embeddings: Optional[int] = None
    """Rows of the learned position table (Megatron-LM's --max-position-embeddings, which it
    requires; None = seq_length). At least seq_length; inert with RoPE."""
    rotary_base: int = 10000
    """RoPE base (Megatron's --rotary-base)."""
    swiglu: bool = True
    """SwiGLU MLPs and experts (Megatron-LM's --swiglu: gated_linear_unit with silu);
    False = GeLU MLPs of one fc1 of F rows (Megatron-LM without --swiglu, GPT-3)."""
    quick_geglu: bool = False
    """GPT-OSS's gated quick-GeLU MLPs and experts (Megatron-LM's --quick-geglu:
    gated_linear_unit with quick_gelu, x * sigmoid(1.702 x), on the gate; with extra
    glu_linear_offset / activation_func_clamp_value, its --glu-linear-offset and
    --activation-func-clamp-value). Not with swiglu (Megatron-LM asserts the same)."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Every norm of the model (Megatron-LM's --normalization; LayerNorm has a bias)."""
    position_embedding_type: Literal["rope", "learned_absolute", "yarn"] = "rope"
    """RoPE, or a learned table of max_position_embeddings positions added to the token
    embedding (Megatron-LM's --position-embedding-type; learned_absolute is its default,
    GPT-3), or YaRN-scaled RoPE of standard attention (Megatron-Core's YarnRotaryEmbedding,
    its parameters the extra.yarn_* fields: config/yarn.py)."""
    untie_embeddings_and_output_weights: bool = True
    """Separate LM head; False = the output layer reuses the word embedding (Megatron-LM's
    --untie-embeddings-and-output-weights; tied is its default, GPT-3)."""
    add_bias_linear: bool = False
    """Biases in attention, MLP, expert and router linears (Megatron-LM's default; its
    --disable-bias-linear gives False). Refused with the variants whose own projections are
    defined without biases (latent, multi_router, multi_view, mh_moe), BitNet and a shared
    expert (MVMoETransformerConfig.validate_mvmoe)."""
    bias_swiglu_fusion: bool = True
    """Megatron-Core's fused SwiGLU (bias_swiglu_impl, torch.compile) in the experts and the
    dense MLP, Megatron-LM's default (--no-bias-swiglu-fusion gives False). On a GPU it
    runs (Triton); on CPU where inductor's C++ compile works and the model is big enough
    for it to pay (models/fast_paths.py SWIGLU_FUSION_MIN_ELEMENTS; the banner's fusions
    line says which). Not structural: the weights are the same, so a resume may switch it
    (tests/layers/test_compiled_fusions.py)."""
    apply_rope_fusion: bool = True
    """TE's fused RoPE (Megatron-LM's --no-rope-fusion gives False). Each fusion switch here:
    True = on where the platform has it (models/fast_paths.py: a GPU with TransformerEngine;
    CPU fuses none of them), False = off
    (tests/platform/test_fast_paths.py::test_megatron_lms_fusion_switches_turn_the_fusion_off).
    Not structural: a fused kernel computes the unfused one's function of the same weights."""
    masked_softmax_fusion: bool = True
    """Megatron's fused scale-mask-softmax (--no-masked-softmax-fusion gives False)."""
    bias_dropout_fusion: bool = True
    """Megatron's fused bias-dropout-add (--no-bias-dropout-fusion gives False)."""
    gradient_accumulation_fusion: bool = True
    """TE linears accumulating the weight gradient into the fp32 main grad in their GEMM
    (--no-gradient-accumulation-fusion gives False)."""
    moe_permute_fusion: bool = True
    """TE's fused token permute/unpermute (--moe-permute-fusion). False on a Megatron-LM line
    without the flag, its parser's default (config/megatron_lm_rules.py)."""
    moe_router_fusion: bool = True
    """TE's fused top-k router (--moe-router-fusion). False on a Megatron-LM line without the
    flag, its parser's default."""
    attention_backend: Literal[ATTENTION_BACKENDS] = "auto"
    """Core attention (Megatron-LM's --attention-backend, plus sdpa). Without
    TransformerEngine: auto, sdpa, flash and fused run torch's scaled_dot_product_attention
    (layers/sdpa_attention.py; PyTorch's flash / memory-efficient kernels on a GPU), unfused
    and local Megatron's DotProductAttention; what SDPA cannot serve (a sliding window, a
    softmax offset) falls back under auto/flash/fused and is refused under sdpa. With TE,
    TE's attention with Megatron-LM's meaning (sdpa refused). Not structural: the weights
    are the same, so a resume may switch it (tests/layers/test_sdpa_attention.py)."""
    multi_view: MultiViewConfig = field(default_factory=MultiViewConfig)
    """Multi-Router / Multi-View: R heads, K views, gamma ramp, gates, kernels (seed 000)."""
    multi_head: MultiHeadConfig = field(default_factory=MultiHeadConfig)
    """MH-MoE: H sub-tokens, head / merge projections (seed 001)."""
    bitnet: BitNetConfig = field(default_factory=BitNetConfig)
    """BitNet b1.58 quantization-aware training of the linear layers (seed 001, Table 3)."""
    extra: Dict[str, Any] = field(default_factory=dict)
    """Megatron TransformerConfig fields this section does not model, passed through."""

    @property
    def variant(self) -> Variant:
        return get_variant(self.moe_variant)

    @property
    def is_moe(self) -> bool:
        return self.variant.routed_experts

    @property
    def is_latent(self) -> bool:
        return self.variant.latent

    @property
    def gated_mlp(self) -> bool:
        """MLPs and experts with a gate (fc1 of 2F rows): SwiGLU or quick-GeGLU."""
        return self.swiglu or self.quick_geglu

    def validate(self, vocab_from_tokenizer: bool = False) -> None:
        """The section's own checks (the variant's requirements on the whole Megatron config
        are MVMoETransformerConfig.validate_mvmoe, run by RunConfig.validate at load).
        `vocab_from_tokenizer`: the vocabulary comes later, from a Megatron-LM tokenizer
        (its size padded, Megatron-LM's rule)."""
        missing = [name for name in _REQUIRED if getattr(self, name) is None
                   and not (name == "vocab_size" and vocab_from_tokenizer)]
        require(not missing, "model", f"{missing} not set",
                f"set model.preset (one of {preset_names()}) or give these fields in the "
                "YAML/flags")
        require(self.max_position_embeddings is None or self.seq_length is None
                or self.max_position_embeddings >= self.seq_length,
                "model.max_position_embeddings",
                f"{self.max_position_embeddings} is below seq_length {self.seq_length}",
                "raise --max-position-embeddings or lower --seq-length")
        try:
            self.variant  # noqa: B018  (unknown variant -> ValueError naming moe_variant)
            self.multi_view.validate(self.num_experts)
            self.bitnet.validate()
        except ValueError as err:
            raise ValueError(run_field_names(str(err))) from None
        self._check_sdpa()
        self._check_activation()
        check_yarn(self.position_embedding_type, self.extra)

    def _check_activation(self) -> None:
        require(not (self.swiglu and self.quick_geglu), "model.quick_geglu",
                "cannot be combined with swiglu (one gated activation)",
                "give --swiglu or --quick-geglu, not both")
        for name, flag in (("glu_linear_offset", "--glu-linear-offset"),
                           ("activation_func_clamp_value", "--activation-func-clamp-value")):
            # Megatron's MLP reads them only in its gated branch: elsewhere they would be
            # silently ignored.
            require(self.gated_mlp or self.extra.get(name) in (None, 0.0), f"model.extra.{name}",
                    "acts only on a gated MLP (Megatron's glu)",
                    f"add --quick-geglu or --swiglu, or drop {flag}")

    def _check_sdpa(self) -> None:
        """An explicit sdpa that SDPA cannot serve is refused (auto falls back instead)."""
        blocker = sdpa_blocker(self.extra) if self.attention_backend == "sdpa" else ""
        require(not blocker, "model.attention_backend", f"sdpa cannot serve {blocker}",
                "use --attention-backend unfused (Megatron's DotProductAttention) or auto")


def position_table_rows(model: ModelSection) -> int:
    """Rows of the learned position table (0 with RoPE): Megatron-LM's
    --max-position-embeddings, else the sequence length."""
    if model.position_embedding_type != "learned_absolute":
        return 0
    return model.max_position_embeddings or model.seq_length


ARCHITECTURE_FIELDS = ("swiglu", "quick_geglu", "normalization", "position_embedding_type",
                       "untie_embeddings_and_output_weights", "add_bias_linear")
"""The architecture switches (Megatron-LM's --swiglu, --normalization, ...): a warm start
or upcycling keeps them."""

FUSION_SWITCHES = ("bias_swiglu_fusion", "apply_rope_fusion", "masked_softmax_fusion",
                   "bias_dropout_fusion", "gradient_accumulation_fusion", "moe_permute_fusion",
                   "moe_router_fusion")
"""Megatron-LM's fusion switches: the platform's fast path runs only where they allow it
(models/fast_paths.py); they hold no weights (checkpointing/fingerprint.py NOT_STRUCTURAL)."""

_REQUIRED = ("moe_variant", "num_layers", "hidden_size", "num_attention_heads",
             "ffn_hidden_size", "vocab_size", "seq_length")
_NESTED = ("multi_view", "multi_head", "bitnet")

LEGACY_FIELDS = {
    "num_routers": ("multi_view", "num_routers"),
    "num_views": ("multi_view", "num_views"),
    "gamma_ramp_steps": ("multi_view", "gamma_ramp_steps"),
    "stop_grad_mixing": ("multi_view", "stop_grad_mixing"),
    "gate_scale": ("multi_view", "gate_scale"),
    "learned_gate_scale": ("multi_view", "learned_gate_scale"),
    "multi_view_kernels": ("multi_view", "kernels"),
    "num_heads_mh": ("multi_head", "num_heads"),
}
"""Flat model fields of earlier versions -> (nested config, field)."""

_MEGATRON_TO_RUN = {
    "num_moe_experts": "model.num_experts",
    "gated_linear_unit": "model.swiglu",
    **{f.name: f"model.{f.name}" for f in dataclasses.fields(ModelSection)
       if f.name not in ("preset", "extra", "num_experts")}}
"""MVMoETransformerConfig names of what the section models -> where a run config sets it.
`extra` must not carry these (they would override the section's own values)."""


def run_field_names(message: str) -> str:
    """An error of our configs' checks ("<field>: ...", named as MVMoETransformerConfig
    names it) with the field named as a run config's YAML / flags write it."""
    field, sep, rest = message.partition(": ")
    if not sep or " " in field or field.startswith("model"):
        return message
    if field in _MEGATRON_TO_RUN:
        where = _MEGATRON_TO_RUN[field]
    elif field.split(".")[0] in _NESTED:
        where = f"model.{field}"
    else:
        where = f"model.extra.{field}"
    return f"{where}: {rest}"


def _as_mapping(value: Any) -> Dict[str, Any]:
    """One of our config objects (as earlier versions put them in `extra`) or a mapping."""
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else dict(value)


def _pop_nested(raw: Dict[str, Any], name: str) -> Dict[str, Any]:
    """raw[name] as a mapping, removed from raw, when it is one (else {}, raw untouched:
    `bitnet: true` is the flat switch of earlier versions)."""
    value = raw.get(name)
    if isinstance(value, Mapping) or dataclasses.is_dataclass(value):
        return _as_mapping(raw.pop(name))
    return {}


def migrate_legacy(raw: Mapping[str, Any]) -> Dict[str, Any]:
    """A model mapping in today's nesting, from any earlier spelling (see module doc)."""
    raw = dict(raw)
    extra = dict(raw.get("extra") or {})
    nested = {name: _pop_nested(raw, name) for name in _NESTED}
    if "bitnet" in raw:  # the flat switch `bitnet: true`
        enabled = raw.pop("bitnet")
        if enabled is not None:
            nested["bitnet"]["enabled"] = enabled
    for name in _NESTED:
        if name in extra:
            nested[name] = deep_merge(_as_mapping(extra.pop(name)), nested[name])
    for old, (section, new) in LEGACY_FIELDS.items():
        value = raw.pop(old, None)
        if value is not None:  # a nested value (e.g. from a flag) wins over the flat one
            nested[section].setdefault(new, value)
    raw.update({name: values for name, values in nested.items() if values})
    if "extra" in raw:
        raw["extra"] = extra
    return raw


def resolve_raw(raw: Mapping[str, Any]) -> Dict[str, Any]:
    """The preset's values with `raw`'s on top, plus the rules that complete a model."""
    raw = migrate_legacy(raw)
    preset = raw.get("preset")
    base: Dict[str, Any] = {}
    if preset is not None:
        require(preset in PRESETS, "model.preset", f"unknown preset {preset!r}",
                f"use one of {preset_names()}")
        base = PRESETS[preset]
    merged = deep_merge(base, raw)
    if merged.get("moe_variant") is None and preset is None:
        # Megatron-LM's rule: --num-experts makes the MLPs routed experts, else dense.
        merged["moe_variant"] = "smoe" if merged.get("num_experts") else "dense"
    if merged.get("num_experts") and merged.get("moe_router_topk") is None:
        merged["moe_router_topk"] = 2  # Megatron-LM's --moe-router-topk default
    views = dict(merged.get("multi_view") or {})
    variant = VARIANTS.get(merged.get("moe_variant"))
    if variant is not None and variant.multi_view and views.get("num_views", 1) == 1:
        views["num_views"] = views.get("num_routers", 1)  # views pair with heads (R = K)
        merged["multi_view"] = views
    return {name: value for name, value in merged.items() if value is not None}


def model_section_from_dict(raw: Optional[Mapping[str, Any]],
                            where: str = "model") -> ModelSection:
    """The resolved and type-checked model of a YAML / JSON / flags mapping (`validate()`
    runs with the rest of the run config: a config may be loaded before its model is
    complete, e.g. a YAML that flags will finish)."""
    if raw is not None and not isinstance(raw, Mapping):
        raise ValueError(f"{where}: expected a mapping of fields, got {raw!r}. Fix: write "
                         f"'{where}:' followed by indented 'field: value' lines")
    section = dataclass_from_dict(ModelSection, resolve_raw(raw or {}), where)
    _check_extra(section.extra)
    return section


def model_from_preset(preset: str, **overrides: Any) -> ModelSection:
    """A preset's model with field overrides (nested ones as mappings), validated, for
    tools."""
    section = model_section_from_dict(dict(overrides, preset=preset))
    section.validate()
    return section


def _check_extra(values: Mapping[str, Any]) -> None:
    """`extra` goes to MVMoETransformerConfig as keyword arguments: names must exist, and
    must not be fields this section models itself."""
    from megatron_mvmoe.config.mla_config import MVMoEMLATransformerConfig  # the widest config

    ours = sorted(set(values) & set(_MEGATRON_TO_RUN))
    require(not ours, "model.extra", f"{ours} are modelled by the model section",
            "set " + ", ".join(_MEGATRON_TO_RUN[name] for name in ours) + " instead")
    known = {f.name for f in dataclasses.fields(MVMoEMLATransformerConfig)}
    unknown = sorted(set(values) - known)
    require(not unknown, "model.extra", f"unknown MVMoETransformerConfig field(s) {unknown}",
            "use names of megatron.core TransformerConfig fields (e.g. moe_aux_loss_coeff)")
