"""One MoE layer per variant, built the way the trainer builds it, timed side by side.

Legend: D hidden size, L latent size, E experts, k top-k, R routing heads (= K views),
F expert FFN width, S shared-expert width, T tokens per forward.

Design choices:
- The layers come from the trainer's own path: a preset's `ModelSection` with the swept
  fields overridden (`model_from_preset`), `provider.transformer_config` (SwiGLU, RMSNorm,
  sigmoid routing + expert bias, the shared expert, the fast paths of this machine), then
  `specs.build_moe_layer`, the builder the decoder block uses. Only `num_layers` (1) and
  the variant's routing heads / views differ between the compared layers.
- Expert implementations compare on the SAME modules: GroupedMatmulExperts is
  SequentialMLP plus a forward, so the "sequential" timing calls `SequentialMLP.forward`
  on the very experts the "grouped" timing runs (`experts_impl`), no second copy of the
  weights (a real-width layer holds 1.6 GB of them).
- Interleaved: each repeat runs every (variant, impl) once in turn, so machine noise (the
  cores are shared) hits all of them alike; ratios are per repeat (same round), reported as
  median with min and max, never a ratio of medians.
- FLOPs are the variant record's analytic FLOPs (`layer_flops_per_token`); achieved
  FLOP/s = 3 x forward FLOPs x T / time (backward ~ 2 x forward).
- Memory on CPU: bytes autograd saves for backward (saved-tensor hooks), deterministic; on
  CUDA the allocator peak of one forward + backward. That pass runs before the timed rounds
  (it is a full step: the warm-up of every layer).
- Two clocks: "wall" (perf_counter), or "cpu" (the process's CPU time, user + system, so
  page faults count): on a machine shared with other jobs the wall clock measures the
  share the scheduler gave, the CPU clock the work itself (run it with one thread: an
  OpenMP team's spin-waits would count too). The matmul peak is measured with the same
  clock before every round, so "% of peak" compares like with like.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from typing import Dict, Iterator, List, Optional, Sequence

import torch

VARIANTS = ("latent", "multi_router", "multi_view")
IMPLS = ("sequential", "grouped")
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """The swept fields of one MoE layer (ModelSection names)."""

    hidden_size: int
    latent_size: int
    num_experts: int
    moe_router_topk: int
    moe_ffn_hidden_size: int
    moe_shared_expert_intermediate_size: Optional[int]
    num_routers: int

    @classmethod
    def of(cls, section) -> "LayerShape":
        return cls(section.hidden_size, section.latent_size, section.num_experts,
                   section.moe_router_topk, section.moe_ffn_hidden_size,
                   section.moe_shared_expert_intermediate_size,
                   max(section.multi_view.num_routers, 1))


def variant_section(preset: str, shape: LayerShape, variant: str):
    """The preset's model section for one variant at `shape` (one layer): the variant
    record's routing heads and views (config/variants.py `head_counts`)."""
    from megatron_mvmoe.config.model_section import model_from_preset
    from megatron_mvmoe.config.presets import PRESETS
    from megatron_mvmoe.config.variants import get_variant

    record = get_variant(variant)
    counts = record.head_counts(shape.num_routers)
    ramp = PRESETS[preset].get("multi_view", {}).get("gamma_ramp_steps", 0)
    multi_view = dict(num_routers=counts["num_routers"], num_views=counts["num_views"],
                      gamma_ramp_steps=ramp if record.multi_view else 0)
    fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(shape)
              if f.name != "num_routers"}
    return model_from_preset(preset, moe_variant=variant, num_layers=1,
                             multi_view=multi_view, **fields)


def layer_config(section, use_bf16: bool, grouped: Optional[bool] = None):
    """The trainer's Megatron config of `section` on this machine; `grouped` overrides the
    fast-path rule's `cpu_grouped_experts` (None: the rule's choice)."""
    from megatron_mvmoe import platform
    from megatron_mvmoe.models.provider import transformer_config

    config = transformer_config(section, use_bf16=use_bf16, on_cpu=not platform.is_cuda())
    config.gradient_accumulation_fusion = False  # it needs DDP's main_grad buffers
    if grouped is not None:
        config.cpu_grouped_experts = grouped
    return config


def layer_flops_per_token(section) -> int:
    """Forward FLOPs per token of one MoE layer of a ModelSection (2 per multiply-add): the
    variant record's matmul count (routers, projections, views, k experts, shared expert)
    plus Multi-View's blend of K views per row (config/variants.py)."""
    from megatron_mvmoe.config.variants import MoEDims

    dims = MoEDims.of(section)
    return section.variant.matmul_flops_per_token(dims) + \
        section.variant.mixing_flops_per_token(dims)


def build_layers(preset: str, shape: LayerShape, pgs, use_bf16: bool = False,
                 variants: Sequence[str] = VARIANTS,
                 grouped: Optional[bool] = None) -> Dict[str, torch.nn.Module]:
    """{variant: its MoE layer} built by the trainer's spec and config path (`grouped`: see
    `layer_config`)."""
    from megatron_mvmoe import platform
    from megatron_mvmoe.models.specs import build_moe_layer

    layers = {}
    for variant in variants:
        config = layer_config(variant_section(preset, shape, variant), use_bf16, grouped)
        layers[variant] = build_moe_layer(config, pgs).to(platform.device())
    return layers


def experts_class(layer) -> str:
    return type(layer.experts).__name__


@contextlib.contextmanager
def experts_impl(layer, impl: str) -> Iterator[None]:
    """Run `layer`'s experts as `impl`: "grouped" as built, "sequential" through
    SequentialMLP.forward on the same modules (GroupedMatmulExperts subclasses it)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    experts = layer.experts
    if impl == "sequential":
        experts.forward = SequentialMLP.forward.__get__(experts)
    try:
        yield
    finally:
        experts.__dict__.pop("forward", None)


def step(layer, x: torch.Tensor) -> None:
    """One forward + backward (the output's sum as the loss)."""
    x = x.detach().requires_grad_(True)
    out, _ = layer(x)
    out.float().sum().backward()
    layer.zero_grad(set_to_none=True)


def saved_activation_bytes(layer, x: torch.Tensor) -> int:
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x = x.detach().requires_grad_(True)
        out, _ = layer(x)
    out.float().sum().backward()
    layer.zero_grad(set_to_none=True)
    return total[0]


def memory_bytes(layer, x: torch.Tensor) -> int:
    from megatron_mvmoe import platform

    if not platform.is_cuda():
        return saved_activation_bytes(layer, x)
    platform.reset_peak_memory()
    step(layer, x)
    platform.synchronize()
    return platform.peak_memory_bytes()


def matmul_peak(dtype: torch.dtype, clock: str = "wall", size: int = 1024,
                budget_s: float = 0.3) -> float:
    """FLOP/s of a square fp matmul on this device, best of repeated timings on `clock`."""
    from megatron_mvmoe import platform

    now = CLOCKS[clock]
    gen = torch.Generator(device=platform.device()).manual_seed(0)  # the run's RNG untouched
    a, b = (torch.randn(size, size, generator=gen, device=platform.device()).to(dtype)
            for _ in range(2))
    best, deadline = 0.0, time.perf_counter() + budget_s
    while time.perf_counter() < deadline or best == 0.0:
        start = now()
        for _ in range(2):
            a @ b
        platform.synchronize()
        best = max(best, 2 * 2 * size ** 3 / max(now() - start, 1e-9))
    return best


def timed_rounds(layers: Dict[str, torch.nn.Module], x: torch.Tensor, impls: Sequence[str],
                 warmup: int, repeats: int, clock: str = "wall",
                 peaks: Optional[List[float]] = None) -> Dict[str, List[float]]:
    """{"variant/impl": [seconds per repeat]}, every pair once per round, in turn, on
    `clock`; `peaks` (if given) gets the matmul peak measured before every timed round."""
    from megatron_mvmoe import platform

    now = CLOCKS[clock]
    pairs = [(v, i) for v in layers for i in impls]
    times: Dict[str, List[float]] = {f"{v}/{i}": [] for v, i in pairs}
    for round_index in range(warmup + repeats):
        if peaks is not None and round_index >= warmup:
            peaks.append(matmul_peak(x.dtype, clock))
        for variant, impl in pairs:
            with experts_impl(layers[variant], impl):
                platform.synchronize()
                start = now()
                step(layers[variant], x)
                platform.synchronize()
                seconds = now() - start
            if round_index >= warmup:
                times[f"{variant}/{impl}"].append(seconds)
    return times


def spread(values: Sequence[float]) -> Dict[str, float]:
    """Median, min and max of per-round values."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def pair_ratios(top: Sequence[float], bottom: Sequence[float]) -> Dict[str, float]:
    """Spread of the per-round ratios top[r] / bottom[r]."""
    return spread([a / b for a, b in zip(top, bottom)])


def summarize(times: Dict[str, List[float]], flops: Dict[str, int], tokens: int,
              peak_flops: float, baseline: str = "latent") -> Dict[str, Dict]:
    """Per variant/impl: time, achieved GFLOP/s and fraction of the peak (spreads), the
    time ratio to the baseline variant with the same impl, the grouped speed-up."""
    rows = {}
    for key, seconds in times.items():
        variant, impl = key.split("/")
        work = 3 * flops[variant] * tokens
        gflops = spread([work / s / 1e9 for s in seconds])
        rows[key] = {"seconds": spread(seconds), "gflops": gflops,
                     "peak_fraction": {k: v * 1e9 / peak_flops for k, v in gflops.items()},
                     "flop_ratio": flops[variant] / flops[baseline],
                     "time_ratio": pair_ratios(seconds, times[f"{baseline}/{impl}"])}
        if impl == "grouped" and f"{variant}/sequential" in times:
            rows[key]["speedup_vs_sequential"] = pair_ratios(times[f"{variant}/sequential"],
                                                             seconds)
    return rows


@contextlib.contextmanager
def single_rank_layout():
    """A one-rank process group (gloo, or NCCL on a GPU) and Megatron's EP = 1 groups."""
    import torch.distributed as dist

    from megatron_mvmoe import platform
    from megatron_mvmoe.launch.local_ranks import free_port
    from megatron_mvmoe.parallel import ParallelLayout, destroy_layout, initialize_layout

    if not platform.is_cuda():
        platform.apply_cpu_patches()
    platform.set_local_device(0)
    dist.init_process_group(platform.backend(), rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        yield initialize_layout(ParallelLayout())
    finally:
        destroy_layout()
        dist.destroy_process_group()
