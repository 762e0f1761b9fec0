"""Planner: parameters, FLOPs, per-GPU memory and all-to-all bytes of a model on a layout.

Legend: D hidden, L latent, E experts, F expert width, k top-k, R routing heads (= K views),
H MH-MoE heads, V vocab, S sequence length, G query groups.

Design choices:
- Parameters and FLOPs per token are config/model_costs.py's (re-exported here), which asks
  each MoE layer's variant record (config/variants.py); tests/planning/test_plan.py checks
  them against the built tiny models exactly, so the 10B-A1B numbers are the ones the
  provider would build. The trainer's MFU reads the same function.
- Memory per GPU (bf16 weights, fp32 grad buffer, distributed optimizer: fp32 main params
  + two Adam moments = 12 bytes per parameter divided over the data-parallel ranks of that
  parameter, expert parameters over the expert-data-parallel ranks). Activations are an
  estimate (bf16, flash attention, no recompute, 1F1B keeps up to pp microbatches in
  flight on the first stage), stated as such.
- All-to-all bytes are the variant record's `a2a_bytes_per_token` (alltoall dispatcher,
  the same rows analysis/a2a/analytic.py counts): the bytes one rank hands to the
  dispatch and combine collectives per optimizer step, forward and backward.
- Context parallelism (`planning.context_parallel`): tokens per rank S b / (cp tp), the
  gathered K/V the CP attention keeps, its K/V all-gather traffic and per-rank attention
  FLOPs; dense optimizer state over DP x CP.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Dict, Optional

from megatron_mvmoe.planning.context_parallel import (context_parallel_report,
                                                           gathered_kv_extra_elements,
                                                           local_tokens)
from megatron_mvmoe.config.model_costs import flops_per_token, mtp_params, parameter_counts
from megatron_mvmoe.config.model_section import ModelSection
from megatron_mvmoe.config.variants import MoEDims


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
        heads = m.multi_head.num_heads
        width = m.variant.expert_input(D, m.latent_size, heads)
        slots = m.moe_router_topk * m.variant.routed_rows(heads)
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
    one = tokens * m.variant.a2a_bytes_per_token(MoEDims.of(m), dtype_bytes)  # alltoall rows
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
