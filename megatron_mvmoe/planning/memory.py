"""Per-rank memory by category, for any model, layout and pipeline stage: what
Megatron-Core 0.19.2 allocates for parameters, gradient buffers, optimizer states and
activations, for the CPU fp32 run and the GPU bf16 + fp32-master run.

Legend: t tokens of one microbatch on this rank (S x B / TP under sequence parallelism),
D hidden, L latent, F expert width, Fs shared-expert width, E experts, k top-k, R routers
(= K views), V vocab, h attention heads, g query groups, S sequence length.

What Megatron allocates (read from megatron/core 0.19.2):
- parameters: DDP moves every parameter into a contiguous `param_data` buffer when the
  distributed optimizer is on (`param_and_grad_buffer.py`; each parameter starts on a
  64-element boundary, the bucket end is padded to a multiple of the data-parallel size);
  otherwise each keeps its own storage. Element size: the params dtype (fp32 on CPU, bf16 on
  GPU); the latent projections are always fp32 (layers/latent_moe.py).
- gradients: `grad_data`, always full size (ZeRO-1, not 2) and fp32 (grad_reduce_in_fp32);
  `param.main_grad` is a view of it. With fp32 params the distributed optimizer's main
  grads are views of the same buffer.
- optimizer: Adam's exp_avg and exp_avg_sq (fp32) for this rank's shard only: dense
  parameters over the data-parallel group, expert parameters over the expert-data-parallel
  group (`distrib_optimizer.py`, `_build_model_and_main_param_groups`). fp32 params: the
  main params are views of `param_data` (no copy); bf16 params: an fp32 master shard
  (`shard_fp32_from_float16_groups`). Without the distributed optimizer nothing is sharded.
- activations: the tensors autograd keeps per layer and microbatch (`attention_elements`,
  `moe_elements`), times the microbatches in flight on this pipeline stage (1F1B:
  min(pp - stage, m); one without a pipeline), plus the step's largest transient. On CPU
  with the grouped expert path (layers/grouped_experts.py, chosen by models/fast_paths.py)
  each forward stacks the local experts' weights ([E, 2F, I] and [E, I, F], a copy autograd
  keeps until that layer's backward) and the backward of the fc1 GEMM holds the stacked
  fc1 weight's gradient while the layer's stacked fc2 is already freed: transient
  E I F elements. Otherwise the transient is two fp32 copies of the largest parameter (its
  gradient before DDP's hook adds it into main_grad; Adam's per-tensor denominator).
- selective recompute (`recomputed_modules`, Megatron's rule): `core_attn` keeps only the
  core attention's inputs, so the softmax output b h S^2 is dropped; `moe` runs the whole
  MoELayer forward under `tensor_parallel.checkpoint` (every variant; MH-MoE: its inner
  MoELayer), which keeps only the layer's input (the pre-MLP norm's output, already counted),
  so `moe_layer_elements` (and, on the grouped CPU path, the stacked expert copies) are
  dropped. One layer's dropped tensors are rebuilt at a time in the backward: that layer's
  worth is added back as `recompute_transient`. Other modules and full granularity are not
  modelled (counted as kept: an over-estimate).
- collectives on gloo (CPU): the distributed optimizer reduce-scatters each gradient
  buffer at the end of the backward and all-gathers each parameter buffer after the
  optimizer step. gloo's `reduce_scatter_tensor` and `all_gather_into_tensor` stage the
  whole buffer (input, resp. output) in a temporary of its size, at any group size, one
  collective at a time (measured: `tools/gloo_collective_memory.py`); NCCL works in place.
  Without overlap DDP keeps one bucket per buffer, so the transient is the larger of this
  rank's dense and expert buffers (`collective_transient`). The backward's happens after
  the last microbatch's backward, when its activations are freed: the step's peak is
  max(activations, collective), not the sum.
- optimizer step (torch's single-tensor AdamW on CPU: foreach is off for CPU tensors):
  one temporary the size of the largest parameter shard (the denominator), then the
  parameter all-gather above (`optimizer_step_transient`); GPU fused Adam adds nothing.
- context parallelism (planning/context_parallel.py): every saved tensor is per local
  token (t = S b / (cp tp)); the CP attention also keeps the other ranks' keys and values,
  and its softmax output is [b, h/tp, S/cp, S] (`cp_attention_correction_elements`); the
  distributed optimizer shards dense state over DP x CP (`dense_optimizer_ranks`).
- checkpoint save (torch_dist, `filesystem_async.prepare_write_data`): before writing,
  every CPU tensor of this rank's share that is a view of a larger storage is cloned, all
  at once (`_clone_or_dequantize_if_needed`). With the distributed optimizer that is every
  parameter this rank writes (views of `param_data`: the experts of expert-data-parallel
  replica 0, the dense ones of data-parallel replica 0) and, with fp32 params, the main
  parameter shards of the dp_reshardable optimizer state (views of the same buffer); Adam's
  moments are tensors of their own and are written in place. GPU tensors are copied to
  host memory later, so on a GPU the save adds nothing to device memory. The save runs
  after the step's backward and optimizer step, so the step's peak is
  max(activations, collective, optimizer step, save), not the sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from megatron_mvmoe.planning.plan import PlanTarget
from megatron_mvmoe.config.model_costs import (attention_params, moe_layer_pattern, moe_params,
                                               mtp_num_layers, mtp_params,
                                               dense_mlp_params)
from megatron_mvmoe.planning.context_parallel import (cp_attention_correction_elements,
                                                           local_tokens)
from megatron_mvmoe.config.model_section import ModelSection
from megatron_mvmoe.parallel import stage_layer_ids

PRECISIONS = ("cpu_fp32", "gpu_bf16")


@dataclass(frozen=True)
class Numerics:
    """Bytes per element of each kind of tensor."""

    param: int
    grad: int
    master: int  # fp32 master copy per parameter (0: the params are the masters)
    activation: int
    flash_attention: bool

    @staticmethod
    def of(precision: str) -> "Numerics":
        if precision == "cpu_fp32":
            return Numerics(param=4, grad=4, master=0, activation=4, flash_attention=False)
        if precision == "gpu_bf16":
            return Numerics(param=2, grad=4, master=4, activation=2, flash_attention=True)
        raise ValueError(f"precision: unknown {precision!r}. Fix: one of {PRECISIONS}")


# ----------------------------------------------------------------------- parameters
def stage_parameters(m: ModelSection, target: PlanTarget, stage: int) -> Dict[str, int]:
    """This rank's parameter counts on pipeline stage `stage`: dense (data-parallel),
    experts (expert-data-parallel), fp32-only (the latent projections, in `dense` too)
    and the largest single tensor."""
    lay = target.layout
    ids = stage_layer_ids(lay, m.num_layers, stage)  # parallel.pp_layout's, else even
    layers = len(ids)
    D, V = m.hidden_size, m.vocab_size
    dense = attention_params(m) // lay.tp * layers  # norms are tiny: split like the rest
    experts = largest = fp32_only = 0
    moe_layers = sum(moe_layer_pattern(m)[i] for i in ids)
    if m.is_moe:
        per = moe_params(m)
        dense += (per["router"] + per["projections"] + per["shared"] // lay.tp) * moe_layers
        fp32_only = per["projections"] * moe_layers
        experts = per["expert_one"] * (m.num_experts // lay.ep) // lay.etp * moe_layers
        width = m.latent_size if m.is_latent else D
        largest = 2 * m.moe_ffn_hidden_size * width // lay.etp
    if layers > moe_layers:  # dense FFN layers (all of a dense model's; moe_layer_freq)
        dense += dense_mlp_params(m, D, m.ffn_hidden_size) // lay.tp * (layers - moe_layers)
    if stage == 0:  # word embedding (split over TP) and a learned position table (not)
        dense += V * D // lay.tp + \
            (m.seq_length * D if m.position_embedding_type == "learned_absolute" else 0)
    if stage == lay.pp - 1:  # LM head (tied: the embedding itself, or its copy at PP > 1)
        own_head = m.untie_embeddings_and_output_weights or lay.pp > 1
        dense += (V * D // lay.tp if own_head else 0) + D
        mtp = mtp_params(m)  # Megatron puts every MTP layer on the last stage
        dense += mtp["non_expert"] // lay.tp
        experts += mtp["experts"] // lay.ep // lay.etp
        fp32_only += moe_params(m)["projections"] * mtp_num_layers(m) if m.is_moe else 0
    largest = max(largest, V * D // lay.tp if stage in (0, lay.pp - 1) else 0,
                  (m.num_attention_heads + 2 * (m.num_query_groups or m.num_attention_heads))
                  * (D // m.num_attention_heads) * D // lay.tp)
    return {"dense": dense, "experts": experts, "fp32_only": fp32_only, "largest": largest}


def static_bytes(m: ModelSection, target: PlanTarget, stage: int, precision: str,
                 distributed_optimizer: bool = True) -> Dict[str, float]:
    """params, grads (main-grad buffers) and optimizer states of one rank, in bytes."""
    n = Numerics.of(precision)
    p = stage_parameters(m, target, stage)
    total = p["dense"] + p["experts"]
    params = (total - p["fp32_only"]) * n.param + p["fp32_only"] * 4
    shard = (p["dense"] / target.dense_optimizer_ranks() + p["experts"] / target.expert_dp()
             if distributed_optimizer else float(total))
    master = (shard - (p["fp32_only"] / target.dense_optimizer_ranks() if distributed_optimizer
                       else p["fp32_only"])) * n.master
    return {"params": float(params), "grads": float(total * n.grad),
            "optimizer": float(8 * shard + master), "params_numel": float(total),
            "optimizer_shard_numel": float(shard)}


# ---------------------------------------------------------------------- activations
def attention_elements(m: ModelSection, t: int, b: int, tp: int, flash: bool) -> float:
    """Saved per layer and microbatch by the attention half (local spec, no dropout): the
    RMSNorm's input, normalised input and output (3 tD), the rotated queries, the keys and
    values repeated to all heads for GQA, the context and its [s, b, hD] copy (5 tD), and
    the softmax output (`attention_score_elements`)."""
    D = m.hidden_size
    return 3 * t * D + 5 * t * D / tp + attention_score_elements(m, t, b, tp, flash)


def attention_score_elements(m: ModelSection, t: int, b: int, tp: int, flash: bool) -> float:
    """The softmax output b h S^2 (flash attention keeps only its log-sum-exp, t h)."""
    h, S = m.num_attention_heads // tp, m.seq_length
    return t * h if flash else b * h * S * S


def moe_elements(m: ModelSection, t: int, tp: int, grouped: bool = False) -> float:
    """Saved per layer and microbatch by the MLP half: the pre-MLP RMSNorm (3 tD), a dense
    MLP's fc1 output and activation (`mlp_elements`), or an MoE layer's `moe_layer_elements`
    (MH-MoE: plus its shared expert, which runs outside the inner MoELayer)."""
    D = m.hidden_size
    base = 3 * t * D
    if not m.is_moe:
        return base + t * mlp_elements(m, m.ffn_hidden_size) / tp
    outside = _shared_expert_elements(m, t, tp) if m.variant.multi_head else 0
    return base + outside + moe_layer_elements(m, t, tp, grouped)


def mlp_elements(m: ModelSection, F: int, grouped: bool = False) -> float:
    """Saved per row by an MLP (an expert) of width F: fc1's output, which the activation
    keeps (2F with SwiGLU, F with GeLU), and the activation, fc2's input (F). The grouped CPU
    experts also keep the activation before its probability scaling (F) and, with SwiGLU,
    SiLU's output (F). Biases add none: the bias add saves nothing for the backward."""
    fc1 = (2 if m.gated_mlp else 1) * F
    kept_by_grouped = fc1 if grouped else 0
    return fc1 + F + kept_by_grouped


def _shared_expert_elements(m: ModelSection, t: int, tp: int) -> float:
    return t * mlp_elements(m, m.moe_shared_expert_intermediate_size or 0) / tp


def moe_layer_elements(m: ModelSection, t: int, tp: int, grouped: bool = False) -> float:
    """Saved inside MoELayer.forward (what `moe` recompute drops): the router (logits,
    scores, probabilities: 3 tE per router and MH-MoE sub-token), the shared expert's
    `mlp_elements` (not MH-MoE's), the down-projected latent (tL), the Multi-View views
    (t R L) and blends (t k L), and per routed slot (t k): the expert input after dispatch,
    the expert's `mlp_elements` and the combined output scaled by its probability.
    `grouped`: the grouped CPU experts (layers/grouped_experts.py) keep more (counted at
    autograd's saved-tensor hook, tests/layers/test_moe_recompute.py)."""
    if not m.is_moe:
        return 0.0
    D = m.hidden_size
    k, F, E = m.moe_router_topk, m.moe_ffn_hidden_size, m.num_experts
    heads, width = _routed_rows_and_width(m)
    routers = m.multi_view.num_routers if m.is_latent else 1
    shared = 0 if m.variant.multi_head else _shared_expert_elements(m, t, tp)
    latent = 2 * t * width if m.is_latent else 0  # down-projected input, up-projection input
    views = 0.0
    if m.variant.multi_view:
        views = t * m.multi_view.num_views * width + t * k * width
    slots = t * k * heads
    per_slot = 2 * width + mlp_elements(m, F, grouped)
    return 3 * t * heads * E * routers + shared + latent + views + slots * per_slot


def _routed_rows_and_width(m: ModelSection):
    """(rows per token, row width) of the routed rows: the variant record's."""
    heads = max(1, m.multi_head.num_heads)
    return m.variant.routed_rows(heads), m.variant.expert_input(m.hidden_size, m.latent_size,
                                                                heads)


def recomputed_modules(m: ModelSection) -> frozenset:
    """The modules Megatron recomputes for this model (TransformerConfig.__post_init__,
    transformer_config.py:1763 and :1835 in 0.19.2): recompute_modules defaults to
    [core_attn] and counts only under selective granularity; moe_layer_recompute turns
    selective on and adds moe. Full granularity is not modelled (empty set)."""
    extra = m.extra
    modules = set(extra.get("recompute_modules") or ["core_attn"])
    granularity = extra.get("recompute_granularity")
    if extra.get("moe_layer_recompute"):
        granularity = "selective"
        modules.add("moe")
    return frozenset(modules) if granularity == "selective" else frozenset()


def loss_elements(m: ModelSection, t: int, tp: int) -> float:
    """Last stage: final norm (3 tD), the logits and the cross entropy's softmax (2 tV)."""
    return 3 * t * m.hidden_size + 2 * t * m.vocab_size / tp


def microbatches_in_flight(target: PlanTarget, stage: int) -> int:
    m = max(1, target.global_batch_size // (target.micro_batch_size * target.dp()))
    return 1 if target.layout.pp == 1 else min(target.layout.pp - stage, m)


def stacked_expert_elements(m: ModelSection, target: PlanTarget) -> Dict[str, int]:
    """Elements of one layer's stacked local expert weights (fc1 [E, G, I] with G = 2F for
    SwiGLU, F for GeLU; fc2 [E, I, F]) on the grouped CPU path."""
    if not m.is_moe:
        return {"fc1": 0, "fc2": 0}
    lay = target.layout
    _, width = _routed_rows_and_width(m)
    local = m.num_experts // lay.ep
    F = m.moe_ffn_hidden_size // lay.etp
    fc1_rows = (2 if m.gated_mlp else 1) * F
    return {"fc1": local * fc1_rows * width, "fc2": local * width * F}


def grouped_experts_on(m: ModelSection, precision: str, bitnet: bool = False) -> bool:
    """Whether the run stacks expert weights per forward: the CPU fast-path rule."""
    if precision != "cpu_fp32" or not m.is_moe:
        return False
    from megatron_mvmoe.models import fast_paths

    paths = fast_paths.choose_fast_paths(fast_paths.Target(cuda=False, te=False),
                                         m.moe_variant, bitnet=bitnet,
                                         expert_elements=fast_paths.expert_matrix_elements(m))
    return any(p.name == "cpu_grouped_experts" and p.on for p in paths)


def activation_bytes(m: ModelSection, target: PlanTarget, stage: int, precision: str,
                     stacked: bool = False) -> Dict[str, float]:
    n, lay = Numerics.of(precision), target.layout
    b = target.micro_batch_size
    t = local_tokens(m, b, lay)  # S b / (cp tp)
    layers = len(stage_layer_ids(lay, m.num_layers, stage))
    recomputed = recomputed_modules(m)
    attn_dropped = attention_score_elements(m, t, b, lay.tp, n.flash_attention) \
        if "core_attn" in recomputed else 0.0
    moe_dropped = moe_layer_elements(m, t, lay.tp, stacked) if "moe" in recomputed else 0.0
    layer = (attention_elements(m, t, b, lay.tp, n.flash_attention)
             + moe_elements(m, t, lay.tp, stacked) - attn_dropped - moe_dropped
             + cp_attention_correction_elements(m, b, lay, n.flash_attention))
    per_mb = layer * layers * n.activation
    if stage == lay.pp - 1:
        per_mb += loss_elements(m, t, lay.tp) * n.activation
    flight = microbatches_in_flight(target, stage)
    stacked_copies = 0.0
    if stacked:
        w = stacked_expert_elements(m, target)
        stacked_copies = 4 * (w["fc1"] + w["fc2"])  # one layer's, kept until its backward
        transient = 4 * (w["fc1"] - w["fc2"])  # fc1's weight grad while fc2's copy is freed
    else:
        transient = 2 * 4 * stage_parameters(m, target, stage)["largest"]
    moe_rebuilt = moe_dropped * n.activation
    if moe_dropped:  # the stacked copies are made inside the recomputed forward
        moe_rebuilt, stacked_copies = moe_rebuilt + stacked_copies, 0.0
    per_mb += stacked_copies * layers
    rebuilt = max(attn_dropped * n.activation, moe_rebuilt)  # one layer's, in its backward
    return {"per_microbatch": float(per_mb), "in_flight": float(flight),
            "transient": float(transient), "recompute_transient": float(rebuilt),
            "activations": per_mb * flight + transient + rebuilt}


def save_transient(m: ModelSection, target: PlanTarget, stage: int, precision: str,
                   distributed_optimizer: bool = True, writes_dense: bool = True,
                   writes_experts: bool = True) -> float:
    """Bytes the checkpoint writer clones on this rank (see the module docstring);
    writes_dense / writes_experts: this rank is replica 0 of its (expert-)data-parallel
    group (the worst case, and the default)."""
    if precision != "cpu_fp32" or not distributed_optimizer:
        return 0.0  # GPU: staged in host memory; without param_data nothing is a view
    p = stage_parameters(m, target, stage)
    n = Numerics.of(precision)
    written = p["dense"] * writes_dense + p["experts"] * writes_experts
    main_shards = p["dense"] / target.dense_optimizer_ranks() + p["experts"] / target.expert_dp()
    return float(n.param * written + 4 * main_shards)


def collective_transient(m: ModelSection, target: PlanTarget, stage: int, precision: str,
                         distributed_optimizer: bool = True) -> float:
    """Bytes gloo stages for the largest buffer's reduce-scatter / all-gather (see the
    module docstring); 0 on GPU (NCCL, in place) and without the distributed optimizer
    (an all-reduce, in place)."""
    if precision != "cpu_fp32" or not distributed_optimizer:
        return 0.0
    p = stage_parameters(m, target, stage)
    return float(4 * max(p["dense"], p["experts"]))  # fp32 grads; fp32 params on CPU


def optimizer_step_transient(m: ModelSection, target: PlanTarget, stage: int, precision: str,
                             distributed_optimizer: bool = True) -> float:
    """The optimizer step's peak over the resident set after the backward: Adam's
    denominator of the largest parameter (sharded by the distributed optimizer's range at
    worst whole), then the parameter all-gather; 0 on GPU (fused Adam, NCCL)."""
    if precision != "cpu_fp32":
        return 0.0
    adam = 4.0 * stage_parameters(m, target, stage)["largest"]
    return max(adam, collective_transient(m, target, stage, precision, distributed_optimizer))


# --------------------------------------------------------------------------- per rank
def rank_memory(m: ModelSection, target: PlanTarget, stage: int, precision: str = "cpu_fp32",
                distributed_optimizer: bool = True, runtime: float = 0.0,
                stacked: Optional[bool] = None, writes=(True, True)) -> Dict[str, float]:
    """Bytes by category of one rank on pipeline stage `stage`; `runtime` is the resident
    memory of the process before the model is built (measured where known, else 0);
    `stacked`: the grouped CPU expert path (None = what the fast-path rule picks)."""
    if stacked is None:
        stacked = grouped_experts_on(m, precision)
    out = static_bytes(m, target, stage, precision, distributed_optimizer)
    act = activation_bytes(m, target, stage, precision, stacked)
    out.update(activations=act["activations"], activations_per_microbatch=act["per_microbatch"],
               microbatches_in_flight=act["in_flight"], step_transient=act["transient"],
               recompute_transient=act["recompute_transient"],
               checkpoint_save_transient=save_transient(m, target, stage, precision,
                                                        distributed_optimizer, *writes),
               collective_transient=collective_transient(m, target, stage, precision,
                                                         distributed_optimizer),
               optimizer_step_transient=optimizer_step_transient(
                   m, target, stage, precision, distributed_optimizer),
               runtime=float(runtime), stacked_expert_weights=float(stacked))
    # forward/backward: the activations, or the grad reduce-scatter at its end
    out["forward_backward"] = max(out["activations"], out["collective_transient"])
    static = out["params"] + out["grads"] + out["optimizer"] + runtime
    step = max(out["forward_backward"], out["optimizer_step_transient"])
    out["total"] = static + step
    out["total_with_save"] = static + max(step, out["checkpoint_save_transient"])
    return out


def memory_by_stage(m: ModelSection, target: PlanTarget, precision: str = "cpu_fp32",
                    distributed_optimizer: bool = True, runtime: float = 0.0) -> List[Dict]:
    """`rank_memory` for every pipeline stage (ranks of a stage differ only by rounding)."""
    return [dict(rank_memory(m, target, s, precision, distributed_optimizer, runtime), stage=s)
            for s in range(target.layout.pp)]


def busiest(stages: List[Dict], key: str = "total_with_save") -> Dict:
    return max(stages, key=lambda s: s[key])


# ------------------------------------------------------------------------ fit check
def _what_to_reduce(m: ModelSection, target: PlanTarget, row: Dict) -> str:
    static = row["params"] + row["grads"] + row["optimizer"]
    lay = target.layout
    hints = []
    if static >= row["activations"]:
        hints.append(f"model.num_layers ({m.num_layers}) or more pipeline stages (pp "
                     f"{lay.pp})")
        if m.is_moe:
            hints.append(f"more expert parallelism across nodes (ep {lay.ep}: "
                         f"{m.num_experts // lay.ep} experts per rank)")
        if m.vocab_size * m.hidden_size > 0.2 * row["params_numel"]:
            hints.append(f"model.vocab_size ({m.vocab_size})")
    hints.append(f"model.seq_length ({m.seq_length}) or training.micro_batch_size "
                 f"({target.micro_batch_size})")
    return "; ".join(hints)


def fit_error(run, world: int, local_ranks: int, available: float,
              runtime: float) -> Optional[str]:
    """None when `local_ranks` ranks of `run` fit in `available` bytes, else the one-line
    error naming the planner's estimate and what to reduce."""
    from megatron_mvmoe.planning.plan import PlanTarget

    m, t = run.model, run.training
    target = PlanTarget(run.parallel.layout(), world_size=world,
                        micro_batch_size=t.micro_batch_size,
                        global_batch_size=t.global_batch_size)
    precision = "cpu_fp32" if run_precision_is_fp32(run) else "gpu_bf16"
    stages = memory_by_stage(m, target, precision, run.optimizer.use_distributed_optimizer,
                             runtime)
    row = busiest(stages)
    need = row["total_with_save"] * local_ranks
    if need <= available:
        return None
    gib = 2 ** 30
    return (f"memory: the planner estimates {row['total_with_save'] / gib:.1f} GiB per rank "
            f"({precision}: params {row['params'] / gib:.1f}, grads {row['grads'] / gib:.1f}, "
            f"optimizer {row['optimizer'] / gib:.1f}, activations "
            f"{row['activations'] / gib:.1f}, optimizer step "
            f"{row['optimizer_step_transient'] / gib:.1f}, runtime {runtime / gib:.1f}, save "
            f"{row['checkpoint_save_transient'] / gib:.1f}) x {local_ranks} ranks on this "
            f"node = {need / gib:.1f} GiB, but {available / gib:.1f} GiB is available. Fix: "
            f"reduce {_what_to_reduce(m, target, row)} (tools/plan.py --config <yaml> shows "
            "the estimate; MVMOE_MEMORY_CHECK=off skips this check)")


def run_precision_is_fp32(run) -> bool:
    """What the trainer will run in: fp32 on CPU (training.precision auto/fp32), else bf16."""
    from megatron_mvmoe import platform

    precision = getattr(run.training, "precision", "auto")
    if precision == "auto":
        return not platform.is_cuda()
    return precision == "fp32"
