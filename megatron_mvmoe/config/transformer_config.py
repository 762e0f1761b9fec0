"""Typed, documented configuration for what megatron_mvmoe adds to Megatron-Core.

Design choices:
- Our additions live in small nested dataclasses (one concept each) hung off a
  `TransformerConfig` subclass, the way Megatron's own `MLATransformerConfig` extends it,
  so every Megatron module still receives the config type it expects.
- Validation raises ValueError naming the field and the fix; it runs in `__post_init__`
  so a bad config fails at start-up, before any process group or weight exists. It is the
  ONE place the variants' requirements are checked (the block spec re-runs it on the final
  config); layers only assert internal invariants.
- The latent size is our own field (`latent_size`), not Megatron's `moe_latent_size`:
  0.19.2 still asserts TransformerEngine on that path, and our latent MoE runs without TE.
- What each variant is made of comes from `megatron_mvmoe.config.variants`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_mvmoe.config.dispatchers import DEFAULT_DISPATCHER, check_dispatcher
from megatron_mvmoe.config.variants import VARIANT_NAMES, get_variant
from megatron_mvmoe.config.yarn import YARN_DEFAULTS
from megatron_mvmoe.errors import require as _require

MOE_VARIANTS = VARIANT_NAMES
KERNEL_BACKENDS = ("auto", "triton", "reference")


@dataclass
class MultiViewConfig:
    """Multi-Router and Multi-View (seed 000, Eq. 2-5)."""

    num_routers: int = 1
    """R: sigmoid routing heads, summed after the sigmoid (Eq. 2). R = 1 is the baseline."""

    num_views: int = 1
    """K: latent views mixed per selected expert (Eq. 4-5). 1 = no view mixing
    (Multi-Router only); otherwise must equal num_routers (one view per head)."""

    gamma_ramp_steps: int = 0
    """Steps over which gamma ramps linearly 0 -> 1 in v_m = P h + gamma dP_m h.
    0 means gamma = 1 from the first step (no ramp)."""

    stop_grad_mixing: bool = False
    """Detach the mixing weights a_{m,i} in the view blend (the paper's ablation):
    routers then get gradient only through the output gates."""

    gate_scale: float = 1.0
    """alpha in Eq. 3: scales the normalised gates (scalar)."""

    learned_gate_scale: bool = False
    """Learn alpha_i per expert (initialised to gate_scale) instead of a fixed scalar."""

    view_init_std: float = 0.02
    """Init std of the view perturbations dP_m (m > 1)."""

    normalizer_eps: float = 1e-6
    """Floor on the selected-score sum in Eq. 3. Megatron uses 1e-20, which lets a
    sigmoid router shrink all scores to game the aux loss (Megatron-LM issue 1545)."""

    kernels: Literal[KERNEL_BACKENDS] = "auto"
    """Mix-and-permute implementation of the Multi-View layer (package mvmoe_kernels):
    "auto" defers to the MVMOE_KERNELS environment variable, whose default picks the fused
    Triton kernel for CUDA tensors and the torch path elsewhere; "triton" forces the kernel
    (on CPU only under TRITON_INTERPRET=1, for tests); "reference" forces the torch path."""

    def validate(self, num_experts: Optional[int] = None) -> None:
        _require(self.num_routers >= 1, "multi_view.num_routers",
                 f"must be >= 1, got {self.num_routers}", "use 1 for the baseline router")
        _require(self.num_views == 1 or self.num_views == self.num_routers,
                 "multi_view.num_views",
                 f"got {self.num_views} views with {self.num_routers} routers; views pair "
                 "one-to-one with routing heads (R = K)",
                 f"set num_views to 1 (Multi-Router only) or {self.num_routers}")
        _require(self.gamma_ramp_steps >= 0, "multi_view.gamma_ramp_steps",
                 f"must be >= 0, got {self.gamma_ramp_steps}", "use 0 for no ramp")
        _require(self.gate_scale > 0, "multi_view.gate_scale",
                 f"must be > 0, got {self.gate_scale}", "use 1.0 for plain normalised gates")
        _require(self.normalizer_eps > 0, "multi_view.normalizer_eps",
                 f"must be > 0, got {self.normalizer_eps}", "use 1e-6")
        _require(self.kernels in KERNEL_BACKENDS, "multi_view.kernels",
                 f"unknown kernel backend {self.kernels!r}",
                 f"use one of {KERNEL_BACKENDS}")


@dataclass
class MultiHeadConfig:
    """MH-MoE (seed 001): head projection, h sub-tokens routed independently, merge."""

    num_heads: int = 1
    """H: sub-tokens per token, each of size D / H, routed on its own."""

    head_projection: bool = True
    """Apply the D x D head projection before splitting (Table 4/5 ablations)."""

    merge_projection: bool = True
    """Apply the D x D merge projection after concatenating (Table 4/5 ablations)."""

    split_tokens: bool = True
    """False keeps whole tokens (SMoE with head/merge projections, Table 4 rows 2 and 4)."""

    def validate(self, hidden_size: int) -> None:
        _require(self.num_heads >= 1, "multi_head.num_heads",
                 f"must be >= 1, got {self.num_heads}", "use 1 for plain SMoE")
        _require(hidden_size % self.num_heads == 0, "multi_head.num_heads",
                 f"{self.num_heads} heads do not divide hidden_size {hidden_size}",
                 "choose a head count that divides hidden_size")
        _require(self.split_tokens or self.num_heads == 1, "multi_head.split_tokens",
                 f"split_tokens=False with num_heads={self.num_heads}: heads only exist when "
                 "tokens are split", "set num_heads=1 for whole-token routing")


@dataclass
class BitNetConfig:
    """BitNet b1.58 quantization-aware training for linear layers (seed 001, Table 3)."""

    enabled: bool = False
    """BitNet b1.58 quantization-aware training: ternary weights {-1, 0, +1} x absmean
    scale, int8 absmax activations, straight-through estimator."""

    activation_bits: int = 8
    """Bits of the per-token absmax activation quantizer."""

    input_norm: bool = True
    """BitLinear's parameter-free RMSNorm of every quantized linear's input, right before
    the activation quantizer (BitNet b1.58: y = W_q Quant(RMSNorm(x))). False quantizes
    the raw input (the behaviour before issue 15)."""

    def validate(self) -> None:
        _require(2 <= self.activation_bits <= 16, "bitnet.activation_bits",
                 f"must be in [2, 16], got {self.activation_bits}", "use 8")


@dataclass
class MVMoETransformerConfig(TransformerConfig):
    """Megatron's TransformerConfig plus the megatron_mvmoe additions."""

    moe_variant: str = "smoe"
    """One of dense, smoe, latent, multi_router, multi_view, mh_moe."""

    moe_token_dispatcher_type: str = "alltoall"
    """Overrides Megatron's default ('allgather'): the alltoall dispatcher is the one whose
    volume Multi-View keeps equal to the baseline (allgather/flex are refused for it)."""

    moe_dispatcher: str = DEFAULT_DISPATCHER
    """The token dispatcher the MoE layers are built with (config/dispatchers.py: alltoall,
    dedup_rank, dedup_node); an unsupported (dispatcher, variant / feature) pair is refused."""

    moe_dispatch_ranks_per_node: Optional[int] = None
    """EP ranks per node for dedup_node (None: the whole EP group is one node)."""

    latent_size: Optional[int] = None
    """L: latent size of the latent MoE (down-projection D -> L before dispatch, up after
    combine). Required for latent, multi_router and multi_view."""

    cpu_grouped_experts: bool = False
    """Run SequentialMLP's experts as grouped GEMMs on CPU (layers/grouped_experts.py: same
    parameters and checkpoints); set by the fast-path rule `cpu_grouped_experts`."""

    sdpa_attention: bool = False
    """Core attention on torch's scaled_dot_product_attention instead of Megatron's local
    DotProductAttention (layers/sdpa_attention.py: same weights and checkpoints); set by the
    fast-path rule `sdpa_attention` from the run's model.attention_backend."""

    # YaRN of standard attention: GPTModel's yarn branch reads these attributes, which
    # TransformerConfig does not declare (config/yarn.py; Megatron-LM's defaults).
    yarn_rotary_scaling_factor: float = YARN_DEFAULTS["yarn_rotary_scaling_factor"]
    """YaRN's context-extension factor (Megatron-LM's --rotary-scaling-factor on a YaRN
    model without MLA)."""
    yarn_original_max_position_embeddings: int = \
        YARN_DEFAULTS["yarn_original_max_position_embeddings"]
    """The pre-extension context YaRN corrects the frequencies for
    (--yarn-original-max-position-embeddings)."""
    yarn_beta_fast: float = YARN_DEFAULTS["yarn_beta_fast"]
    """YaRN's fast correction bound (--yarn-beta-fast)."""
    yarn_beta_slow: float = YARN_DEFAULTS["yarn_beta_slow"]
    """YaRN's slow correction bound (--yarn-beta-slow)."""
    yarn_mscale: float = YARN_DEFAULTS["yarn_mscale"]
    """YaRN's mscale (Megatron-LM's --mscale on a YaRN model without MLA)."""
    yarn_mscale_all_dim: float = YARN_DEFAULTS["yarn_mscale_all_dim"]
    """YaRN's mscale_all_dim (Megatron-LM's --mscale-all-dim on a YaRN model without MLA)."""
    yarn_correction_range_round_to_int: bool = \
        YARN_DEFAULTS["yarn_correction_range_round_to_int"]
    """Round YaRN's correction range to whole dimensions
    (--[no-]yarn-correction-range-round-to-int)."""

    multi_view: MultiViewConfig = field(default_factory=MultiViewConfig)
    multi_head: MultiHeadConfig = field(default_factory=MultiHeadConfig)
    bitnet: BitNetConfig = field(default_factory=BitNetConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.validate_mvmoe()

    def validate_mvmoe(self) -> None:
        """Every requirement of the variant on the whole config (ValueError naming the field)."""
        variant = get_variant(self.moe_variant)
        self.bitnet.validate()
        _require(not (self.bitnet.enabled and self.moe_grouped_gemm), "moe_grouped_gemm",
                 "TE's grouped experts are not BitNet linears, so BitNet would leave the "
                 "experts full precision", "set moe_grouped_gemm=False under BitNet")
        self._validate_biases(variant)
        if variant.routed_experts or self.moe_dispatcher != DEFAULT_DISPATCHER:
            check_dispatcher(self)
        if not variant.routed_experts:
            _require(not self.num_moe_experts, "num_moe_experts",
                     f"moe_variant='dense' but {self.num_moe_experts} experts are set",
                     "set num_moe_experts=None or choose an MoE variant")
            return
        self._validate_experts()
        if variant.latent:
            self._validate_latent()
        if variant.multi_view:
            self._validate_multi_view()
        if variant.multi_head:
            self._validate_multi_head()

    def _validate_biases(self, variant) -> None:
        """Biased linears (Megatron-LM's default, GPT-3) where their math is defined: the
        latent family's projections and views and MH-MoE's head/merge projections are
        defined without biases (seed 000 / 001), BitNet b1.58's BitLinear has none, and
        Megatron's shared expert asserts bias-free linears; MLA with biases is not counted
        yet."""
        if not self.add_bias_linear:
            return
        fix = "add --disable-bias-linear (model.add_bias_linear false)"
        _require(not (variant.latent or variant.multi_head), "add_bias_linear",
                 f"variant {self.moe_variant}'s own projections are defined without biases",
                 fix + " or use moe_variant smoe / dense")
        _require(not self.bitnet.enabled, "add_bias_linear",
                 "BitNet b1.58's BitLinear has no bias", fix + " or drop BitNet")
        _require(not self.moe_shared_expert_intermediate_size, "add_bias_linear",
                 "Megatron's shared expert has no biases",
                 fix + " or drop the shared expert")
        _require(not getattr(self, "multi_latent_attention", False), "add_bias_linear",
                 "MLA's biases are not in the parameter and FLOP counts "
                 "(config/model_costs.py)", fix + " or drop --multi-latent-attention")

    def _validate_experts(self) -> None:
        num_experts = self.num_moe_experts
        _require(num_experts is not None and num_experts >= 1, "num_moe_experts",
                 f"variant {self.moe_variant} needs experts, got {num_experts}",
                 "set num_moe_experts >= 1 or use moe_variant='dense'")
        _require(1 <= self.moe_router_topk <= num_experts, "moe_router_topk",
                 f"top-k {self.moe_router_topk} must be in [1, num_moe_experts={num_experts}]",
                 f"use a top-k of at most {num_experts}")
        ep = self.expert_model_parallel_size
        _require(num_experts % ep == 0, "num_moe_experts",
                 f"{num_experts} experts do not divide over expert_model_parallel_size={ep}",
                 "choose an EP size that divides the expert count")
        validate_capacity(self)

    def _validate_latent(self) -> None:
        _require(self.latent_size is not None and self.latent_size > 0, "latent_size",
                 f"variant {self.moe_variant} needs a positive latent size, got "
                 f"{self.latent_size}", "set latent_size (e.g. hidden_size // 2)")
        _require(not self.moe_latent_size, "moe_latent_size",
                 "Megatron's TE-only latent path would project twice",
                 "leave moe_latent_size None and set latent_size")
        _require(not self.moe_shared_expert_overlap, "moe_shared_expert_overlap",
                 "the dispatcher's shared-expert overlap would see latent rows, not hidden "
                 "states", "set moe_shared_expert_overlap=False")
        self.multi_view.validate(self.num_moe_experts)

    def _validate_multi_view(self) -> None:
        _require(self.multi_view.num_views == self.multi_view.num_routers,
                 "multi_view.num_views",
                 f"multi_view needs one view per routing head, got {self.multi_view.num_views} "
                 f"views for {self.multi_view.num_routers} heads",
                 f"set num_views = num_routers = {self.multi_view.num_routers}")
        _require(self.moe_token_dispatcher_type == "alltoall", "moe_token_dispatcher_type",
                 f"{self.moe_token_dispatcher_type!r} sends each token once per rank, so "
                 "per-expert mixed rows would cost up to top-k times the baseline volume",
                 "use moe_token_dispatcher_type='alltoall' (same bytes as the baseline)")

    def _validate_multi_head(self) -> None:
        self.multi_head.validate(self.hidden_size)
        _require(not self.moe_shared_expert_overlap, "moe_shared_expert_overlap",
                 "the shared expert runs on the full token outside the sub-token MoE",
                 "set moe_shared_expert_overlap=False")
        _require(not self.moe_latent_size, "moe_latent_size",
                 "MH-MoE does not combine with Megatron's latent projections", "leave it None")
        _require(self.moe_token_dispatcher_type in ("alltoall", "allgather"),
                 "moe_token_dispatcher_type",
                 f"{self.moe_token_dispatcher_type!r} is not tested with MH-MoE",
                 "use 'alltoall'")


def validate_capacity(config) -> None:
    """Padding to capacity needs C <= T: Megatron's drop-and-pad permute keeps at most the T
    tokens of a rank per expert, and C = ceil(T*k/E * factor) exceeds T exactly when
    factor * k > E (for every T), which fails there with a reshape error."""
    factor = config.moe_expert_capacity_factor
    if factor is None or not config.moe_pad_expert_input_to_capacity:
        return
    limit = config.num_moe_experts / config.moe_router_topk
    if factor > limit:
        raise ValueError(
            f"moe_expert_capacity_factor: {factor} with moe_pad_expert_input_to_capacity pads "
            f"every expert to more rows than a rank has tokens (factor x top-k > experts), "
            f"which Megatron's drop-and-pad permute cannot hold. Fix: a factor <= "
            f"{limit:g} (E / k), or moe_pad_expert_input_to_capacity=False")

