"""Which fast path each run takes, and why any is off: one decision for provider and planner.

On a GPU with TransformerEngine a 10B-A1B run must not loop over experts in Python with
unfused kernels; on CPU (gloo, no TE/apex) the local equivalents run. Every decision is a
`FastPath` with the Megatron config fields it sets and the reason, so `tools/plan.py
--fast-paths` prints exactly what the provider builds.

Design choices:
- The target is explicit (`Target(cuda, te)`), never read from globals inside the rules:
  the planner asks "what would a GPU node with TE do" on this CPU machine.
- Rules follow what Megatron-Core 0.19.2 itself requires: grouped GEMM on the local backend
  is SequentialMLP anyway (legacy GroupedMLP is gone), RoPE fusion and flash attention need
  TE, gradient-accumulation fusion needs TE linears (or apex), overlapped grad-reduce /
  param-gather need asynchronous (NCCL) collectives to overlap with.
- On CPU, SequentialMLP's per-expert loop is replaced by `cpu_grouped_experts` (the same
  parameters, two torch._grouped_mm calls) where that is faster, a measured criterion: one
  expert's matrix (I x F elements, I = its input width) at most
  GROUPED_MM_MAX_EXPERT_ELEMENTS. torch's CPU _grouped_mm is itself a loop of GEMMs, so
  all it saves is SequentialMLP's per-expert Python/autograd overhead, while it pays for
  copying every expert weight into a stacked [E, G, I] tensor each forward (and the
  stacked grad back in backward), page faults of the fresh GB-sized buffers included:
  that copy grows with I x F, the overhead it saves does not. Not under BitNet (its expert
  linears are Bit linears), and only where torch runs _grouped_mm on CPU.
- Without TE (CPU, a GPU image without it, BitNet) the core attention is torch's SDPA
  (`sdpa_attention`, layers/sdpa_attention.py) unless model.attention_backend asks for
  Megatron's unfused / local module or SDPA cannot serve the model (then the reason is the
  banner's attention line).
- Megatron-Core's own elementwise fusions (`bias_swiglu_impl`: SwiGLU of the experts and the
  dense MLP) are its `jit_fuser`, torch.compile: Triton on a GPU, inductor's C++ backend on
  CPU. On CPU they run where Megatron-LM's --bias-swiglu-fusion (model.bias_swiglu_fusion)
  asks, inductor compiles here (platform/inductor_probe.py) and one SwiGLU call is big
  enough for the fused kernel to beat eager despite its per-call dispatch
  (SWIGLU_FUSION_MIN_ELEMENTS, measured): the call the chosen expert path makes, one
  expert's rows under SequentialMLP, every local expert's rows on the grouped path
  (`swiglu_calls`); smaller models (the tests', and issue 42's smoe benchmark shapes) stay
  eager, so they never compile.
- A fusion runs only where the platform has it AND the run allows it: Megatron-LM's
  switches (--no-rope-fusion, --no-gradient-accumulation-fusion, ... and the opt-in
  --moe-permute-fusion / --moe-router-fusion, model fields: config/model_section.py) turn an
  available fusion off, and the `why` says so (`run_switches_off`). So do two limits of the
  run itself: RoPE fusion only for plain RoPE (Megatron-LM's validate_args) and, for MLA,
  YaRN (Megatron-Core asserts it); and gradient-accumulation fusion not under Megatron-FSDP's
  unsharded gradients (`UNSHARDED_FSDP_GRADS`).
- BitNet quantizes Megatron's local Column/RowParallelLinear: TE linears (and so TE grouped
  experts, fused RoPE, TE attention) are off under BitNet, with that reason.
- Multi-View's per-row dispatcher gathers (token, slot) rows itself: TE's fused permute
  (`moe_permute_fusion`) gathers replicated tokens and stays off for it; the rows still go
  through the same grouped experts. Multi-Router heads replace TE's fused router
  (`moe_router_fusion`); our own fused Triton routing kernel is their fast path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from megatron_mvmoe.config.variants import get_variant

GROUPED_MM_MAX_EXPERT_ELEMENTS = 1 << 16
"""Largest I x F of one expert for which the grouped path beats SequentialMLP's loop on CPU.
Measured (examples/results/grouped_experts.md: whole MoE layers, fwd + bwd, CPU time of one
thread, both paths on the same weights, interleaved): SequentialMLP / grouped time per
round 1.9-3.3 at I x F = 512 and 0.84-1.53 (median 1.06-1.24) at 32768; 0.54-0.94 at
131072 (two shapes) and 0.62-0.86 at the 10B-A1B's 1015808 (256 x 3968, 4096 tokens).
The threshold sits between the last point where grouped wins and the first where it loses."""

SWIGLU_FUSION_MIN_ELEMENTS = 1 << 18
"""Smallest SwiGLU call (rows x F output elements, `swiglu_calls`) for which Megatron's
compiled SwiGLU runs on CPU. Measured (examples/results/peer_benchmark.md, "SwiGLU on
CPU"; one thread, forward + backward, CPU time): eager / compiled 0.39 at 2^10 elements,
0.55 at 2^15, 0.82 at 2^17, 1.31 at 2^18, 1.4-1.5 at 2^20-2^21. Each compiled call pays
a fixed dispatch (dynamo guards, AOT-autograd wrappers, Megatron's autograd.Function) that
eager's three kernels undercut until the tensors are large."""


NOT_PROBED = "not probed for this target"
"""Target.inductor_blocker where inductor was not tried: CPU fusions stay off."""


@dataclass(frozen=True)
class Target:
    """The machine a run is built for."""

    cuda: bool
    te: bool
    """TransformerEngine importable (Megatron's `HAVE_TE`)."""
    inductor_blocker: str = NOT_PROBED
    """Why torch.compile's inductor cannot build CPU code here ('' = it can), unless
    `probe_inductor`. Only CPU fusions read it; a GPU compiles with Triton."""
    probe_inductor: bool = False
    """Ask platform/inductor_probe.py (one real compile, once per process) instead of
    `inductor_blocker`, at the moment a CPU fusion rule needs the answer: a model whose
    SwiGLU calls are too small to fuse never compiles."""

    @classmethod
    def here(cls) -> "Target":
        from megatron.core.models.gpt import gpt_layer_specs

        from megatron_mvmoe import platform

        return cls(cuda=platform.is_cuda(), te=bool(gpt_layer_specs.HAVE_TE))

    @classmethod
    def cpu(cls, probe_inductor: bool = False) -> "Target":
        """This process's CPU; `probe_inductor`: compile once, where a fusion rule asks, to
        learn whether inductor works here."""
        return cls(cuda=False, te=False, probe_inductor=probe_inductor)

    def compile_blocker(self) -> str:
        """Why inductor cannot compile CPU code for this target ('' = it can)."""
        if not self.probe_inductor:
            return self.inductor_blocker
        from megatron_mvmoe.platform.inductor_probe import inductor_blocker

        return inductor_blocker()


@dataclass(frozen=True)
class FastPath:
    name: str
    on: bool
    why: str
    fields: Dict[str, Any] = field(default_factory=dict)
    """TransformerConfig fields this decision sets (DDP fields are prefixed `ddp.`)."""
    run_off: bool = False
    """Off because the run asks it (`run_switches_off`), where the platform has it."""


def expert_matrix_elements(section, etp: int = 1) -> Optional[int]:
    """I x F of one routed expert of a ModelSection: its input width (the latent size, else
    the hidden size per MH-MoE head) times its FFN width on one expert-TP rank; None for a
    model without routed experts (a dense model may leave moe_ffn_hidden_size unset)."""
    if not section.is_moe or section.moe_ffn_hidden_size is None:
        return None
    if section.is_latent and not section.latent_size:
        return None  # an unset latent size: validation names the field, not this rule
    width = section.variant.expert_input(section.hidden_size, section.latent_size,
                                         max(1, section.multi_head.num_heads))
    return width * (section.moe_ffn_hidden_size // max(1, etp))


@dataclass(frozen=True)
class SwigluCalls:
    """Output elements (rows x F) of one SwiGLU call of a model on each expert path, one
    sequence per micro-batch (more sequences only make the calls larger): what the CPU
    fusion threshold is compared with. 0 when the MLPs are not SwiGLU (GeLU: no call)."""

    sequential: int
    """SequentialMLP calls each expert's MLP on its own rows (the dense MLP: all rows)."""
    grouped: int
    """cpu_grouped_experts calls SwiGLU once on every local expert's rows."""

    def on_path(self, grouped: bool) -> int:
        return self.grouped if grouped else self.sequential


def swiglu_calls(section, etp: int = 1) -> SwigluCalls:
    """SwigluCalls of a ModelSection: seq x ffn_hidden_size in a dense model; in a MoE model
    its (token, slot) rows, seq x routed rows per token (MH-MoE's sub-tokens) x top-k,
    spread evenly over the experts, times each expert-TP rank's FFN width. SequentialMLP
    sees one expert's share (a lower bound: with EP each expert also gets the other EP
    ranks' rows); the grouped path all of them (a rank's E/ep experts get ep ranks' share:
    seq x top-k rows again), except at expert TP > 1, where it falls back to SequentialMLP's
    loop."""
    if not section.swiglu:
        return SwigluCalls(0, 0)
    seq = section.seq_length or 0
    if not (section.is_moe and section.moe_ffn_hidden_size):
        dense = seq * (section.ffn_hidden_size or 0)
        return SwigluCalls(dense, dense)
    rows = (seq * section.variant.routed_rows(max(1, section.multi_head.num_heads))
            * section.moe_router_topk)
    width = section.moe_ffn_hidden_size // max(1, etp)
    one_expert = rows // section.num_experts * width
    return SwigluCalls(one_expert, rows * width if etp <= 1 else one_expert)


def choose_fast_paths(target: Target, variant: str, bitnet: bool = False,
                      distributed_optimizer: bool = True,
                      expert_elements: Optional[int] = None,
                      attention_backend: str = "auto",
                      sdpa_blocker: str = "", swiglu_fusion: bool = True,
                      swiglu_size: Optional[SwigluCalls] = None,
                      run_off: Optional[Mapping[str, str]] = None) -> List[FastPath]:
    """Every fast-path decision for one model variant on `target`; `expert_elements`:
    `expert_matrix_elements` of the model (None: not known, the CPU grouped path stays on);
    `attention_backend`: the model's (Megatron-LM's --attention-backend, or sdpa);
    `sdpa_blocker`: why SDPA cannot serve the model (layers/sdpa_attention.sdpa_blocker);
    `swiglu_fusion`: Megatron-LM's --bias-swiglu-fusion; `swiglu_size`: `swiglu_calls` of
    the model (None: not known, CPU stays eager), read on the expert path chosen here;
    `run_off`: fast path -> why the run keeps it off (`run_switches_off`)."""
    gpu = target.cuda
    te = gpu and target.te and not bitnet
    no_te = _no_te_reason(target, bitnet)
    record = get_variant(variant)
    moe, per_row = record.routed_experts, record.multi_view  # per-(token, expert) rows
    heads_router = record.multi_router
    grouped = _cpu_grouped_experts(target, variant, bitnet, expert_elements)
    call_size = None if swiglu_size is None else swiglu_size.on_path(grouped.on)
    return _allowed_by_run(run_off or {}, [
        _path("transformer_engine_specs", te, "TE layer specs (fused LN+linear, TE linears)",
              no_te),
        _path("grouped_gemm", te and moe,
              "TEGroupedMLP: one grouped GEMM over all local experts",
              no_te + " (SequentialMLP loops over local experts)" if moe else "dense model",
              {"moe_grouped_gemm": te and moe}),
        grouped,
        _path("flash_attention", te, "TEDotProductAttention (flash/fused backend)",
              no_te + " (torch SDPA or Megatron's DotProductAttention: sdpa_attention)"),
        _sdpa_attention(te, attention_backend, sdpa_blocker),
        _path("rope_fusion", te, "TE fused RoPE", no_te, {"apply_rope_fusion": te}),
        _bias_activation_fusion(target, swiglu_fusion, call_size),
        _path("bias_dropout_fusion", gpu, "fused bias-dropout-add", "CPU: unfused add",
              {"bias_dropout_fusion": gpu}),
        _path("masked_softmax_fusion", gpu, "fused scale-mask-softmax kernel",
              "CPU: torch softmax", {"masked_softmax_fusion": gpu}),
        _path("gradient_accumulation_fusion", te, "weight-grad GEMM accumulates into fp32 main "
              "grads (TE linears)", no_te + " (separate accumulate)",
              {"gradient_accumulation_fusion": te}),
        _path("moe_permute_fusion", te and not per_row,
              "TE fused token permute/unpermute",
              "the per-row dispatcher gathers (token, slot) rows itself"
              if te else no_te, {"moe_permute_fusion": te and not per_row}),
        _path("fused_router", te and not heads_router,
              "TE fused top-k router", _router_reason(heads_router, no_te),
              {"moe_router_fusion": te and not heads_router}),
        _path("multi_router_triton_kernel", gpu and heads_router,
              "fused Triton routing (and mix+permute) kernels",
              "not a multi-head router" if not heads_router else
              "CPU: pure-torch reference path (Triton runs only under TRITON_INTERPRET)"),
        _path("overlap_grad_reduce", gpu, "DP grad reduce-scatter overlaps the backward",
              "CPU/gloo: synchronous collectives, nothing to overlap",
              {"ddp.overlap_grad_reduce": gpu}),
        _path("overlap_param_gather", gpu and distributed_optimizer,
              "param all-gather overlaps the next forward",
              "CPU/gloo: synchronous collectives" if not gpu else
              "needs the distributed optimizer",
              {"ddp.overlap_param_gather": gpu and distributed_optimizer}),
        _path("bf16", gpu, "bf16 weights and activations, fp32 main params",
              "CPU: fp32 (bf16 matmuls are emulated and slow)"),
    ])


RUN_SWITCHES = (
    ("rope_fusion", "apply_rope_fusion", "--no-rope-fusion", "unfused RoPE"),
    ("masked_softmax_fusion", "masked_softmax_fusion", "--no-masked-softmax-fusion",
     "torch softmax"),
    ("bias_dropout_fusion", "bias_dropout_fusion", "--no-bias-dropout-fusion", "unfused add"),
    ("gradient_accumulation_fusion", "gradient_accumulation_fusion",
     "--no-gradient-accumulation-fusion", "separate accumulate"),
    ("moe_permute_fusion", "moe_permute_fusion", "without --moe-permute-fusion",
     "unfused permute, Megatron-LM's default"),
    ("fused_router", "moe_router_fusion", "without --moe-router-fusion",
     "unfused router, Megatron-LM's default"),
)
"""(fast path, its ModelSection switch, how a launch line sets it false, what runs then)."""

UNSHARDED_FSDP_GRADS = ("no_shard", "optim")
"""Megatron-FSDP strategies whose gradient buffers are not sharded: Megatron-Core 0.19.2's
Megatron-FSDP sets `param.overwrite_main_grad` for every strategy (megatron_fsdp.py), so
TE's fused weight-gradient GEMM overwrites these buffers each microbatch instead of adding
to them; Megatron-LM later sets it only for optim_grads / optim_grads_params (342faa43cd)."""


def run_switches_off(section, optimizer=None) -> Dict[str, str]:
    """Fast path -> why the run keeps it off, for a ModelSection and the run's
    OptimizerSection (None: no Megatron-FSDP)."""
    off = {path: f"{flag} (model.{name} false): {instead}"
           for path, name, flag, instead in RUN_SWITCHES if not getattr(section, name)}
    rope = _rope_fusion_blocker(section)
    if rope:
        off.setdefault("rope_fusion", rope)
    strategy = optimizer.data_parallel_sharding_strategy if optimizer is not None and \
        optimizer.megatron_fsdp else None
    if strategy in UNSHARDED_FSDP_GRADS:
        off.setdefault("gradient_accumulation_fusion", (
            f"Megatron-FSDP's {strategy} keeps unsharded gradients, which Megatron-Core "
            "0.19.2 lets TE's fused GEMM overwrite each microbatch (overwrite_main_grad; "
            "fixed later in Megatron-LM, 342faa43cd): separate accumulate"))
    return off


def _rope_fusion_blocker(section) -> str:
    """Why the model's RoPE is not fused even where TE could: Megatron-LM's validate_args
    fuses only --position-embedding-type rope, and Megatron-Core MLA's fused RoPE only
    YaRN (MLATransformerConfig raises otherwise)."""
    if section.position_embedding_type != "rope":
        return (f"--position-embedding-type {section.position_embedding_type}: Megatron-LM "
                "fuses only plain RoPE")
    extra = section.extra or {}
    if extra.get("multi_latent_attention") and extra.get("rope_type", "yarn") != "yarn":
        return f"MLA with --rope-type {extra['rope_type']}: Megatron-Core fuses only YaRN's"
    return ""


def _allowed_by_run(run_off: Mapping[str, str], paths: List[FastPath]) -> List[FastPath]:
    """Each path on only where the platform has it AND the run allows it."""
    return [FastPath(p.name, False, run_off[p.name], {k: False for k in p.fields}, True)
            if p.on and p.name in run_off else p for p in paths]


def _cpu_grouped_experts(target: Target, variant: str, bitnet: bool,
                         expert_elements: Optional[int] = None) -> FastPath:
    """SequentialMLP's experts as two torch._grouped_mm calls (layers/grouped_experts.py)
    where the measured criterion says they are faster."""
    from megatron_mvmoe.layers.grouped_experts import grouped_mm_runs_here

    if not get_variant(variant).routed_experts:
        why_off = "dense model"
    elif target.cuda:
        why_off = "GPU: TEGroupedMLP with TE, else SequentialMLP (not validated on CUDA)"
    elif bitnet:
        why_off = "BitNet: the experts are Bit linears (SequentialMLP loops over them)"
    elif not grouped_mm_runs_here():
        why_off = "torch._grouped_mm does not run on this CPU build (SequentialMLP loops)"
    elif expert_elements is not None and expert_elements > GROUPED_MM_MAX_EXPERT_ELEMENTS:
        why_off = (f"CPU: one expert is I x F = {expert_elements} > "
                   f"{GROUPED_MM_MAX_EXPERT_ELEMENTS} elements, where SequentialMLP's loop is "
                   "faster than stacking every expert weight for torch._grouped_mm (measured)")
    else:
        why_off = ""
    size = "" if expert_elements is None else f", one expert I x F = {expert_elements} <= " \
        f"{GROUPED_MM_MAX_EXPERT_ELEMENTS}"
    return _path("cpu_grouped_experts", not why_off,
                 "CPU: all local experts as 2 grouped GEMMs (torch._grouped_mm), "
                 f"SequentialMLP's parameters{size}", why_off, {"cpu_grouped_experts": not why_off})


def _bias_activation_fusion(target: Target, requested: bool,
                            size: Optional[int]) -> FastPath:
    """Megatron's fused SwiGLU (bias_swiglu_impl, its torch.compile'd jit_fuser)."""
    if size == 0:  # Megatron fuses GeLU only with a bias, and neither GeLU in experts that
        # scale rows by their probs (SequentialMLP) nor quick-GeGLU without them
        why_off = "the model's MLPs are not SwiGLU (GeLU): none to fuse"
    elif not requested:
        why_off = "--no-bias-swiglu-fusion: unfused SwiGLU"
    elif target.cuda:
        why_off = ""
    elif size is None:
        why_off = "CPU: the SwiGLU call's size is not known here: unfused SwiGLU"
    elif size < SWIGLU_FUSION_MIN_ELEMENTS:
        why_off = (f"CPU: a SwiGLU call of {size} elements < {SWIGLU_FUSION_MIN_ELEMENTS}, "
                   "where eager beats a compiled call (measured): unfused SwiGLU")
    elif blocker := target.compile_blocker():  # last: the probe compiles
        why_off = f"CPU: {blocker}: unfused SwiGLU"
    else:
        why_off = ""
    how = "Triton" if target.cuda else "inductor C++"
    return _path("bias_activation_fusion", not why_off,
                 f"fused SwiGLU (Megatron's bias_swiglu_impl, torch.compile: {how})", why_off,
                 {"bias_activation_fusion": not why_off})


def fusions_line(paths: List[FastPath]) -> str:
    """The start-up banner's line: which elementwise fusions run, and why (not); the
    switchable ones only where the platform has them (on, or off by the run)."""
    swiglu = next(p for p in paths if p.name == "bias_activation_fusion")
    switchable = {switch[0] for switch in RUN_SWITCHES}
    others = [f"{p.name} on" if p.on else f"{p.name} off ({p.why})" for p in paths
              if p.name in switchable and (p.on or p.run_off)]
    return f"fusions: SwiGLU {'on' if swiglu.on else 'off'} ({swiglu.why})" + \
        "".join(f"; {text}" for text in others)


SDPA_BACKENDS = ("auto", "sdpa", "flash", "fused")
"""--attention-backend values served by torch SDPA where TE is absent: auto (Megatron-LM's
auto picks TE's fused/flash kernels; SDPA is the nearest without TE), sdpa, and flash / fused
(SDPA's own flash and memory-efficient kernels on a GPU). unfused / local keep Megatron's
DotProductAttention."""


def _sdpa_attention(te: bool, backend: str, blocker: str) -> FastPath:
    """torch SDPA as the core attention (layers/sdpa_attention.py) where TE is absent."""
    from megatron_mvmoe.layers.sdpa_attention import torch_version

    from megatron_mvmoe.errors import require

    require(not (te and backend == "sdpa"), "model.attention_backend",
            "sdpa replaces Megatron's local core attention, and this machine builds "
            "TransformerEngine's", "use --attention-backend auto / flash / fused (TE's "
            "kernels) here")
    if te:
        why_off = f"TEDotProductAttention runs (--attention-backend {backend})"
    elif backend not in SDPA_BACKENDS:
        why_off = f"--attention-backend {backend} asks for it"
    elif blocker:
        why_off = f"{blocker}: falls back"
    else:
        why_off = ""
    return _path("sdpa_attention", not why_off,
                 f"torch scaled_dot_product_attention (torch {torch_version()}; "
                 f"--attention-backend {backend})", why_off,
                 {"sdpa_attention": not why_off})


def attention_line(paths: List[FastPath]) -> str:
    """The start-up banner's line: which core attention runs, and why."""
    flash = next(p for p in paths if p.name == "flash_attention")
    if flash.on:
        return "attention: TransformerEngine (TEDotProductAttention)"
    sdpa = next(p for p in paths if p.name == "sdpa_attention")
    if sdpa.on:
        from megatron_mvmoe.layers.sdpa_attention import torch_version

        return f"attention: sdpa (torch {torch_version()})"
    return f"attention: unfused (Megatron's DotProductAttention; {sdpa.why})"


def _path(name: str, on: bool, why_on: str, why_off: str,
          fields: Dict[str, Any] = None) -> FastPath:
    return FastPath(name, bool(on), why_on if on else why_off, dict(fields or {}))


def _no_te_reason(target: Target, bitnet: bool) -> str:
    if not target.cuda:
        return "no CUDA device"
    if bitnet:
        return "BitNet quantizes Megatron's local linears (TE layers would stay full precision)"
    if not target.te:
        return "TransformerEngine not installed"
    return ""


def _router_reason(heads_router: bool, no_te: str) -> str:
    if heads_router:
        return "R routing heads: TE's fused router scores one head"
    return no_te


def config_fields(paths: List[FastPath]) -> Dict[str, Any]:
    """The TransformerConfig fields of every decision (without the `ddp.` ones)."""
    return {k: v for p in paths for k, v in p.fields.items() if not k.startswith("ddp.")}


def ddp_fields(paths: List[FastPath]) -> Dict[str, Any]:
    """DistributedDataParallelConfig fields of every decision."""
    return {k[len("ddp."):]: v for p in paths for k, v in p.fields.items()
            if k.startswith("ddp.")}


def is_on(paths: List[FastPath], name: str) -> bool:
    return next(p.on for p in paths if p.name == name)


def as_dict(paths: List[FastPath]) -> Dict[str, Dict[str, Any]]:
    return {p.name: {"on": p.on, "why": p.why} for p in paths}
