"""Planner: parameters, FLOPs, per-GPU memory and all-to-all bytes of a model on a layout.

Legend: D hidden, L latent, E experts, F expert width, k top-k, R routing heads (= K views),
H MH-MoE heads, V vocab, S sequence length, G query groups.

Design choices:
- Parameter counts are analytic, per module, mirroring what models/provider.py builds
  (Megatron's local spec: RMSNorm weight only, no biases, SwiGLU fc1 of 2F rows, untied
  embedding and LM head, RoPE). tests/training/test_plan.py checks them against the built
  tiny models exactly, so the 10B-A1B numbers are the ones the provider would build.
- "Active" = every non-expert parameter + k routed experts per MoE layer (embedding and
  LM head included; `active_without_embeddings` is given too).
- FLOPs per token: 2 x active matmul parameters (the embedding lookup excluded) + attention
  scores/values 4 x S x D per layer (non-causal count); training = 3 x forward.
- Memory per GPU (bf16 weights, fp32 grad buffer, distributed optimizer: fp32 main params
  + two Adam moments = 12 bytes per parameter divided over the data-parallel ranks of that
  parameter, expert parameters over the expert-data-parallel ranks). Activations are an
  estimate (bf16, flash attention, no recompute, 1F1B keeps up to pp microbatches in
  flight on the first stage), stated as such.
- All-to-all bytes use `analysis.a2a_analytic` (alltoall dispatcher): the bytes one rank
  hands to the dispatch and combine collectives per optimizer step, forward and backward.
- Context parallelism (`plan_context_parallel`): tokens per rank S b / (cp tp), the
  gathered K/V the CP attention keeps, its K/V all-gather traffic and per-rank attention
  FLOPs; dense optimizer state over DP x CP.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Dict, Optional

from megatron_mvmoe.analysis.a2a.analytic import CommShape, dispatch_bytes
from megatron_mvmoe.analysis.plan_context_parallel import (context_parallel_report,
                                                           gathered_kv_extra_elements,
                                                           local_tokens)
from megatron_mvmoe.config.model_section import ModelSection


if TYPE_CHECKING:  # annotations only: plan.py stays importable without Megatron
    from megatron_mvmoe.parallel import ParallelLayout


@dataclass(frozen=True)
class PlanTarget:
    """What the planner sizes: a parallel layout on a world size, training one batch."""

    layout: ParallelLayout
    world_size: Optional[int] = None
    """GPUs; None = the smallest world the layout divides (`smallest_world_size`)."""
    micro_batch_size: int = 1
    global_batch_size: int = 256

    def world(self) -> int:
        return self.world_size if self.world_size is not None else \
            self.layout.smallest_world_size()

    def dp(self) -> int:
        return self.layout.data_parallel_size(self.world())

    def expert_dp(self) -> int:
        return self.layout.expert_data_parallel_size(self.world())

    def dense_optimizer_ranks(self) -> int:
        """Ranks the distributed optimizer splits dense state over: data x context
        parallel (Megatron's DDP buffers span both)."""
        return self.dp() * self.layout.cp

    def as_dict(self) -> Dict[str, int]:
        """The report's "layout" entry (the keys tools/plan.py --json has always printed)."""
        lay = self.layout
        return {"tp": lay.tp, "pp": lay.pp, "ep": lay.ep, "etp": lay.etp, "cp": lay.cp,
                "world_size": self.world(), "micro_batch_size": self.micro_batch_size,
                "global_batch_size": self.global_batch_size, "dp": self.dp(),
                "expert_dp": self.expert_dp()}


def planned_world_size(config_path: Optional[str], field: Optional[int],
                       flag: Optional[int]) -> Optional[int]:
    """The world size to plan for: --world-size, else the YAML's parallel.world_size, else
    the "<N>gpu" in the YAML's file name; they must agree when several are given.
    None = none given (the layout's smallest world)."""
    named = None
    if config_path is not None:
        match = re.search(r"(\d+)gpus?(?![a-z])", os.path.basename(config_path).lower())
        named = int(match.group(1)) if match else None
    given = {"--world-size": flag, "parallel.world_size": field, "the file name": named}
    values = {k: v for k, v in given.items() if v is not None}
    if len(set(values.values())) > 1:
        raise ValueError("world size: " + ", ".join(f"{k} says {v}" for k, v in values.items())
                         + ". Fix: make them agree (set parallel.world_size in the YAML)")
    return next(iter(values.values()), None)


def check_layout(m: ModelSection, target: PlanTarget) -> None:
    """Refuse a layout the trainer would refuse (same checks: ParallelLayout.validate and
    the batch divisibility of RunConfig)."""
    target.layout.validate(target.world(), m.num_layers, m.num_experts,
                           seq_length=m.seq_length)
    step = target.micro_batch_size * target.dp()
    if target.global_batch_size % step:
        raise ValueError(f"training.global_batch_size: {target.global_batch_size} is not "
                         f"divisible by micro_batch_size * data-parallel size = "
                         f"{target.micro_batch_size} * {target.dp()}. Fix: use a multiple of "
                         f"{step}")


# ------------------------------------------------------------------------- parameters
def attention_params(m: ModelSection) -> int:
    """One layer's attention (standard or MLA) plus its input and pre-MLP RMSNorm weights."""
    if m.extra.get("multi_latent_attention"):
        return mla_params(m) + 2 * m.hidden_size
    kv_channels = m.hidden_size // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    qkv = (m.num_attention_heads + 2 * groups) * kv_channels * m.hidden_size
    proj = m.hidden_size * m.num_attention_heads * kv_channels
    qk_norms = 2 * kv_channels if m.extra.get("qk_layernorm") else 0
    return qkv + proj + qk_norms + 2 * m.hidden_size


def mla_params(m: ModelSection) -> int:
    """Megatron's MLASelfAttention (config/mla_config.py's defaults for fields not set): query
    projection (direct, or down to q_lora_rank and up), the kv down projection to the latent
    plus the RoPE key part, the kv up projection to per-head keys and values, the output
    projection, and the q/kv latent norms with --qk-layernorm."""
    from megatron_mvmoe.config.mla_config import MVMoEMLATransformerConfig

    defaults = MVMoEMLATransformerConfig.__dataclass_fields__

    def field(name):
        return m.extra.get(name, defaults[name].default)

    D, h = m.hidden_size, m.num_attention_heads
    qk, pos, v = field("qk_head_dim"), field("qk_pos_emb_head_dim"), field("v_head_dim")
    q_rank, kv_rank, norms = field("q_lora_rank"), field("kv_lora_rank"), \
        bool(m.extra.get("qk_layernorm"))
    if q_rank is None:
        query = D * h * (qk + pos)
    else:
        query = D * q_rank + q_rank * h * (qk + pos) + (q_rank if norms else 0)
    kv = D * (kv_rank + pos) + kv_rank * h * (qk + v) + (kv_rank if norms else 0)
    return query + kv + h * v * D


def swiglu(d_in: int, width: int) -> int:
    return 3 * d_in * width  # fc1 [2F, d_in] + fc2 [d_in, F]


def moe_params(m: ModelSection) -> Dict[str, int]:
    """One MoE layer's parameters split into expert and non-expert (per variant)."""
    D, E, F, k = m.hidden_size, m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk
    shared = swiglu(D, m.moe_shared_expert_intermediate_size or 0)
    if m.moe_variant == "mh_moe":
        sub = D // m.multi_head.num_heads
        return {"expert_one": swiglu(sub, F), "router": E * sub,
                "projections": 2 * D * D, "shared": shared}
    if m.is_latent:
        L = m.latent_size
        views = (m.multi_view.num_views - 1) * L * D if m.moe_variant == "multi_view" else 0
        return {"expert_one": swiglu(L, F), "router": m.multi_view.num_routers * E * D,
                "projections": 2 * L * D + views, "shared": shared}
    return {"expert_one": swiglu(D, F), "router": E * D, "projections": 0, "shared": shared}


def mtp_num_layers(m: ModelSection) -> int:
    """Multi-token prediction depth (Megatron's `mtp_num_layers`, given through `extra`)."""
    return int(m.extra.get("mtp_num_layers") or 0)


def _layer_mlp(m: ModelSection) -> Dict[str, int]:
    """One decoder layer's MLP: all its parameters, its experts, and what one token uses."""
    if not m.is_moe:
        dense = swiglu(m.hidden_size, m.ffn_hidden_size)
        return {"dense": dense, "non_expert": 0, "experts": 0, "active": dense}
    per = moe_params(m)
    active_slots = m.moe_router_topk * (m.multi_head.num_heads if m.moe_variant == "mh_moe"
                                        else 1)  # MH-MoE: each of H sub-tokens selects k
    non_expert = per["router"] + per["projections"] + per["shared"]
    return {"dense": 0, "non_expert": non_expert, "experts": per["expert_one"] * m.num_experts,
            "active": non_expert + per["expert_one"] * active_slots}


def mtp_params(m: ModelSection) -> Dict[str, int]:
    """The MTP block (models/mtp_spec.py: Megatron's MultiTokenPredictionLayer): per layer
    enorm + hnorm + final norm (D each), eh_proj [D, 2D], and a copy of the last decoder
    layer (attention + its MLP). Embedding and LM head are the main model's (shared)."""
    n = mtp_num_layers(m)
    D, mlp = m.hidden_size, _layer_mlp(m)
    own = 3 * D + 2 * D * D + attention_params(m)
    return {"total": n * (own + mlp["dense"] + mlp["non_expert"] + mlp["experts"]),
            "active": n * (own + mlp["active"]), "experts": n * mlp["experts"],
            "non_expert": n * (own + mlp["dense"] + mlp["non_expert"])}


def parameter_counts(m: ModelSection) -> Dict[str, int]:
    """Every parameter the provider builds, MTP layers included ("mtp": their share)."""
    D, V = m.hidden_size, m.vocab_size
    embedding, head, final_norm = V * D, V * D, D
    attention = attention_params(m) * m.num_layers
    mlp, mtp = _layer_mlp(m), mtp_params(m)
    dense = mlp["dense"] * m.num_layers
    non_expert_moe = mlp["non_expert"] * m.num_layers
    experts = mlp["experts"] * m.num_layers
    base = embedding + head + final_norm + attention + dense + non_expert_moe
    active = base + (mlp["active"] - mlp["dense"] - mlp["non_expert"]) * m.num_layers \
        + mtp["active"]
    return {"total": base + experts + mtp["total"], "active": active,
            "active_without_embeddings": active - embedding - head,
            "embedding": embedding, "lm_head": head, "attention": attention,
            "experts": experts, "expert_one": moe_params(m)["expert_one"] if m.is_moe else 0,
            "non_expert_moe": non_expert_moe, "dense_mlp": dense, "mtp": mtp["total"]}


def flops_per_token(m: ModelSection) -> Dict[str, float]:
    """Each MTP layer adds its own active matmuls plus one more pass of the shared LM head,
    and one more layer of attention scores."""
    counts = parameter_counts(m)
    n_mtp = mtp_num_layers(m)
    matmul = counts["active"] - counts["embedding"] + n_mtp * counts["lm_head"]
    attention_scores = 4 * m.seq_length * m.hidden_size * (m.num_layers + n_mtp)
    forward = 2 * matmul + attention_scores
    return {"forward": float(forward), "train": float(3 * forward)}


# -------------------------------------------------------------------------- memory
def _per_rank_params(m: ModelSection, lay: ParallelLayout) -> Dict[str, float]:
    """Parameters on the busiest pipeline stage (first or last), split by sharding."""
    c, mtp = parameter_counts(m), mtp_params(m)
    per_layer_dense = (c["attention"] + c["non_expert_moe"] + c["dense_mlp"]) / m.num_layers
    layers = m.num_layers / lay.pp
    last = c["lm_head"] + m.hidden_size + mtp["non_expert"]  # the MTP block is on the last
    edge = max(c["embedding"], last) if lay.pp > 1 else c["embedding"] + last
    dense = (per_layer_dense * layers + edge) / lay.tp
    experts = (c["experts"] / m.num_layers * layers + mtp["experts"]) / (lay.ep * lay.etp) \
        if m.is_moe else 0.0
    return {"dense": dense, "experts": experts}


def _activation_bytes(m: ModelSection, target: PlanTarget) -> float:
    lay = target.layout
    s, b, D = m.seq_length // lay.cp, target.micro_batch_size, m.hidden_size  # CP: S/cp each
    attention = 11 * s * b * D * 2 / lay.tp  # norms, qkv, attn out, proj in/out (bf16)
    attention += gathered_kv_extra_elements(m, b, lay) * 2  # CP: the other ranks' K/V
    if m.is_moe:
        width = m.latent_size if m.is_latent else D // max(1, m.multi_head.num_heads)
        slots = m.moe_router_topk * max(1, m.multi_head.num_heads)
        ffn = s * b * (2 * D + 3 * (m.moe_shared_expert_intermediate_size or 0)
                       + slots * (2 * width + 3 * m.moe_ffn_hidden_size)) * 2 / lay.tp
    else:
        ffn = s * b * (2 * D + 3 * m.ffn_hidden_size) * 2 / lay.tp
    in_flight = min(lay.pp, max(1, target.global_batch_size // (b * target.dp())))
    return (attention + ffn) * (m.num_layers / lay.pp) * in_flight


def memory_per_gpu(m: ModelSection, target: PlanTarget,
                   weight_bytes: int = 2) -> Dict[str, float]:
    p = _per_rank_params(m, target.layout)
    params = p["dense"] + p["experts"]
    optimizer = 12 * (p["dense"] / target.dense_optimizer_ranks()
                      + p["experts"] / target.expert_dp())
    out = {"weights": params * weight_bytes, "grads": params * 4, "optimizer": optimizer,
           "activations_estimate": _activation_bytes(m, target)}
    out["total"] = sum(out.values())
    return out


# ------------------------------------------------------------------------ all-to-all
def a2a_bytes_per_step(m: ModelSection, target: PlanTarget,
                       dtype_bytes: int = 2) -> Dict[str, float]:
    lay = target.layout
    if not m.is_moe or lay.ep == 1:
        return {"per_layer_dispatch": 0.0, "per_rank_per_step": 0.0}
    tokens = local_tokens(m, target.micro_batch_size, lay)  # the CP and sequence-parallel slice
    variant = "smoe" if m.moe_variant == "dense" else m.moe_variant
    shape = CommShape(tokens=tokens, hidden=m.hidden_size, topk=m.moe_router_topk,
                      latent=m.latent_size, heads=m.multi_head.num_heads, dtype_bytes=dtype_bytes,
                      ep=lay.ep, tp=lay.tp)
    one = dispatch_bytes(variant, "alltoall", shape).tokens_in
    microbatches = target.global_batch_size // (target.micro_batch_size * target.dp())
    layers = m.num_layers / lay.pp
    # dispatch + combine, forward + backward: four transfers of `one` bytes on average.
    return {"per_layer_dispatch": float(one),
            "per_rank_per_step": float(4 * one * layers * microbatches)}


def plan(m: ModelSection, target: PlanTarget) -> Dict:
    microbatches = target.global_batch_size // (target.micro_batch_size * target.dp())
    return {"model": asdict(m), "layout": target.as_dict(),
            "parameters": parameter_counts(m), "flops_per_token": flops_per_token(m),
            "memory_bytes_per_gpu": memory_per_gpu(m, target),
            "a2a_bytes": a2a_bytes_per_step(m, target),
            "context_parallel": context_parallel_report(m, target.layout,
                                                        target.micro_batch_size, microbatches)}


# --------------------------------------------------------------------------- dry run
def dry_run_build(m: ModelSection, target: PlanTarget) -> Dict[str, int]:
    """Build rank 0's model chunk of `target` on the meta device (no memory, no real peers).

    Uses torch's in-process "fake" process group with the layout's world size, Megatron's
    own initialize_model_parallel (without gloo side groups, which the fake backend cannot
    create) and the real provider, so every shape and the layout's divisibility are checked
    exactly as a launch would. Returns rank 0's parameter count. Call in a fresh process.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megatron_mvmoe.models.provider import (build_model_chunks, count_parameters,
                                                transformer_config)
    from megatron_mvmoe.platform import apply_cpu_patches

    apply_cpu_patches()
    lay, world = target.layout, target.world()
    check_layout(m, target)
    dist.init_process_group(backend="fake", store=FakeStore(), rank=0, world_size=world)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
            context_parallel_size=lay.cp,
            expert_model_parallel_size=lay.ep, expert_tensor_parallel_size=lay.etp,
            create_gloo_process_groups=False)
        config = transformer_config(m, tp=lay.tp, pp=lay.pp, ep=lay.ep, etp=lay.etp,
                                    cp=lay.cp, use_bf16=True, on_cpu=True)
        config.perform_initialization = False
        with torch.device("meta"):
            chunks = build_model_chunks(config, m, ProcessGroupCollection.use_mpu_process_groups())
        return {"rank0_parameters": count_parameters(chunks), "world_size": world}
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
