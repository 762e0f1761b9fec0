"""Parallel layout (TP, PP, CP, EP, expert-TP) on top of Megatron-Core's parallel state.

Design choices:
- A `ParallelLayout` is validated against the world size and the model *before* any
  process group exists, so a layout that does not divide fails with the sizes named and
  the sizes that would divide.
- Megatron's own `initialize_model_parallel` builds the groups; we hand back its
  `ProcessGroupCollection` so layers receive process groups explicitly instead of reading
  global state deep inside forward.
- Every subgroup gets the run's collective timeout (`timeout_s`), so a hung rank stalls its
  peers in a subgroup collective no longer than in a world one.
- `destroy_layout` tears the groups down: leaked gloo subgroups pile up threads (notes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import List, Literal, Optional

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

PP_LAYOUT = "parallel.pp_layout (--pipeline-model-parallel-layout)"
_LAYOUT_FIX = ("write stages of E (embedding), t (decoder layer), m (MTP layer), L (loss) "
               "split by '|', e.g. 'Et|ttL' or 'Et*3|(tt|)*2,mL'")


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ParallelLayout:
    """How one model is spread over the world. The run config's parallel section
    (config/run_config.ParallelSection) extends it, so each size is declared and documented
    once; not frozen because run configs are edited in place (--unset, tool overrides)."""

    tp: int = 1
    """Tensor-parallel size (attention and dense MLP shards); MoE with tp > 1 turns
    sequence parallelism on."""
    pp: int = 1
    """Pipeline-parallel stages."""
    ep: int = 1
    """Expert-parallel size: experts are split over this many ranks (all-to-all group)."""
    etp: int = 1
    """Expert tensor-parallel size (1 keeps each expert whole; Megatron-LM's default is the
    TP size)."""
    vpp: Optional[int] = None
    """Virtual pipeline chunks per rank (interleaved 1F1B), or None."""
    pp_layout: Optional[str] = None
    """Megatron-LM's --pipeline-model-parallel-layout: which stage holds the embedding (E),
    each decoder layer (t), the MTP layers (m) and the loss (L), e.g. 'Et|ttL' (pp 2:
    1 + 2 layers); pp*vpp stages split by '|', vpp follows from their count. None = the
    layers split evenly over pp*vpp stages."""
    cp: int = 1
    """Context-parallel size: each sequence is split over this many ranks (load-balanced
    chunks, layers/cp_attention.py); the sequence length must divide by 2*cp."""
    rank_order: Literal["tp-cp-ep-dp-pp", "tp-cp-ep-pp-dp"] = "tp-cp-ep-dp-pp"
    """How global ranks map onto the groups, innermost first (Megatron-Core's `order`):
    pipeline stages outermost, or with Megatron-LM's --use-tp-pp-dp-mapping data-parallel
    replicas outermost. Where each rank sits, not what it computes."""
    distributed_optimizer_instances: int = 1
    """Copies of the distributed optimizer across the data-parallel ranks (Megatron-LM's
    --num-distributed-optimizer-instances): each shards its state over DP / this many ranks
    and the copies all-reduce their gradients; needs the distributed optimizer."""

    def layout(self) -> "ParallelLayout":
        """The sizes alone, as a plain ParallelLayout (a run config's section carries more)."""
        return ParallelLayout(**{f.name: getattr(self, f.name) for f in fields(ParallelLayout)})

    def layout_vpp(self) -> Optional[int]:
        """The virtual-pipeline size pp_layout gives (its stages / pp; 1 is None), as
        Megatron-LM's validate_args derives it; ValueError naming the flag when the string
        does not parse, does not divide by pp, or disagrees with a given vpp."""
        try:
            stages = PipelineParallelLayerLayout.get_num_stages_from_str(self.pp_layout)
        except AssertionError as err:
            raise ValueError(f"{PP_LAYOUT}: {_one_line(err)}. Fix: {_LAYOUT_FIX}") from None
        if stages % self.pp != 0:
            raise ValueError(
                f"{PP_LAYOUT}: {self.pp_layout!r} has {stages} stages, not a multiple of "
                f"--pipeline-model-parallel-size {self.pp}. Fix: give pp*vpp stages")
        vpp = stages // self.pp if stages > self.pp else None
        if self.vpp is not None and self.vpp != vpp:
            raise ValueError(
                f"{PP_LAYOUT}: {self.pp_layout!r} gives {stages // self.pp} virtual stages "
                f"per rank but parallel.vpp is {self.vpp}. Fix: drop "
                "--virtual-pipeline-model-parallel-size (the layout sets it)")
        return vpp

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)

    def expert_data_parallel_size(self, world_size: int) -> int:
        """Ranks holding the same expert shard (the expert optimizer state is split over)."""
        return world_size // (self.ep * self.etp * self.pp)

    def smallest_world_size(self) -> int:
        """The fewest ranks the layout divides: a multiple of both tp*pp*cp and ep*etp*pp,
        times the distributed-optimizer instances, which split both the data-parallel and
        the expert data-parallel group (validate refuses a world where they do not)."""
        instances = self.distributed_optimizer_instances
        return math.lcm(self.tp * self.pp * self.cp * instances,
                        self.ep * self.etp * self.pp * instances)

    def validate(self, world_size: int, num_layers: Optional[int] = None,
                 num_experts: Optional[int] = None, training: bool = True,
                 seq_length: Optional[int] = None) -> None:
        """Raise ValueError naming the sizes when the layout does not divide (or, with
        `training` and experts, when Megatron would leave expert gradients unreduced)."""
        for name in ("tp", "pp", "cp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise ValueError(f"layout.{name} must be >= 1, got {getattr(self, name)}")
        model_ranks = self.tp * self.pp * self.cp
        if world_size % model_ranks != 0:
            # CP is named only when it is used (the message of a CP=1 layout stays tp*pp).
            names, sizes = ("tp*pp*cp", f"{self.tp}*{self.pp}*{self.cp}") if self.cp > 1 \
                else ("tp*pp", f"{self.tp}*{self.pp}")
            raise ValueError(
                f"layout: {names} = {sizes} = {model_ranks} does not divide world size "
                f"{world_size}. Fix: choose {names} among {_divisors(world_size)}.")
        if seq_length is not None and seq_length % (2 * self.cp) != 0:
            raise ValueError(
                f"layout.cp: seq_length {seq_length} is not divisible by 2*cp = {2 * self.cp} "
                f"(each CP rank takes two load-balanced chunks). Fix: pick cp with 2*cp among "
                f"{_divisors(seq_length)}.")
        if world_size % (self.etp * self.ep * self.pp) != 0:
            raise ValueError(
                f"layout: etp*ep*pp = {self.etp}*{self.ep}*{self.pp} does not divide world "
                f"size {world_size}. Fix: choose ep with ep*etp*pp among "
                f"{_divisors(world_size)}.")
        if training and num_experts and self.ep == 1 and self.etp < self.tp:
            raise ValueError(
                f"layout: ep=1 with etp={self.etp} < tp={self.tp}. Megatron-Core tags expert "
                "weights as dense when expert parallelism is off and reduces their gradients "
                "over the data-parallel group only, so the tensor-parallel ranks that feed "
                "the same whole experts different tokens would never sum their expert "
                f"gradients. Fix: use etp={self.tp}, or ep > 1 (e.g. ep=2 with etp=1).")
        self._check_instances(world_size)
        if self.pp_layout is not None:
            self.layout_vpp()  # the stage count; the layers are counted with the model's MTP
        elif num_layers is not None and num_layers % (self.pp * (self.vpp or 1)) != 0:
            raise ValueError(
                f"layout: num_layers {num_layers} is not divisible by pp*vpp = "
                f"{self.pp}*{self.vpp or 1}. Fix: pick pp*vpp among {_divisors(num_layers)}.")
        if num_experts is not None and num_experts % self.ep != 0:
            raise ValueError(
                f"layout: num_moe_experts {num_experts} is not divisible by ep {self.ep}. "
                f"Fix: pick ep among {_divisors(num_experts)}.")

    def _check_instances(self, world_size: int) -> None:
        """The distributed-optimizer instances split the data-parallel group and, as
        Megatron-Core asserts on every rank after the launch, the expert data-parallel one."""
        instances = self.distributed_optimizer_instances
        if instances < 1 or self.data_parallel_size(world_size) % instances != 0:
            raise ValueError(
                f"layout.distributed_optimizer_instances: {instances} does not divide the "
                f"data-parallel size {self.data_parallel_size(world_size)}. Fix: choose it among "
                f"{_divisors(self.data_parallel_size(world_size))}.")
        expert_dp = self.expert_data_parallel_size(world_size)
        if expert_dp % instances != 0:
            raise ValueError(
                f"layout.distributed_optimizer_instances: {instances} does not divide the "
                f"expert data-parallel size {expert_dp} (world / (ep*etp*pp)). Fix: choose it "
                f"among {_divisors(expert_dp)}, or a world size that makes {instances} divide it.")


def stage_layer_ids(layout: ParallelLayout, num_layers: int, stage: int) -> List[int]:
    """The decoder layers (0-based) pipeline rank `stage` holds over its virtual stages:
    pp_layout's placement, else an even contiguous split (num_layers // pp each)."""
    if layout.pp_layout is None:
        per = num_layers // layout.pp
        return list(range(stage * per, (stage + 1) * per))
    # Counted here: Megatron's get_layer_id_list reads the virtual stage from parallel_state,
    # which a planner (no process groups) does not have.
    parsed = PipelineParallelLayerLayout(layout.pp_layout, layout.pp)
    ids, first = [], 0
    for vp in range(parsed.virtual_pipeline_model_parallel_size):
        for rank in range(layout.pp):
            count = parsed.layout[rank][vp].count(LayerType.decoder)
            ids += list(range(first, first + count)) if rank == stage else []
            first += count
    return ids


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def check_layer_layout(layout: ParallelLayout, num_layers: int, mtp_num_layers: int) -> None:
    """Megatron-Core's checks of pp_layout against the model (each decoder layer and MTP
    layer placed once, E first, L last), as ValueError naming the flag."""
    try:
        PipelineParallelLayerLayout(layout.pp_layout, layout.pp).validate_layer_layout(
            num_layers, mtp_num_layers)
    except AssertionError as err:
        raise ValueError(f"{PP_LAYOUT}: {_one_line(err)} (model: {num_layers} layers, "
                         f"{mtp_num_layers} MTP). Fix: {_LAYOUT_FIX}") from None


DEFAULT_TIMEOUT_S = 600.0
"""Collective timeout of every subgroup unless the run gives its own (Megatron's default,
30 minutes, would let a hung rank stall the job that long)."""


def initialize_layout(layout: ParallelLayout, num_layers: Optional[int] = None,
                      num_experts: Optional[int] = None, training: bool = True,
                      timeout_s: float = DEFAULT_TIMEOUT_S,
                      seq_length: Optional[int] = None) -> ProcessGroupCollection:
    """Build Megatron's parallel state for `layout` on the initialised default group; every
    subgroup (TP, PP, DP, EP, their gloo twins) gets the collective timeout `timeout_s`.

    `training=False` admits layouts that are only valid for forward/backward without the
    data-parallel gradient reduction (layer-level tests)."""
    if not dist.is_initialized():
        raise RuntimeError("initialize_layout needs torch.distributed initialised first "
                           "(megatron_mvmoe.launch.init_distributed or the test spawner).")
    layout.validate(dist.get_world_size(), num_layers, num_experts, training=training,
                    seq_length=seq_length)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        distributed_timeout_minutes=timeout_s / 60.0,
        order=layout.rank_order,
        num_distributed_optimizer_instances=layout.distributed_optimizer_instances,
    )
    return ProcessGroupCollection.use_mpu_process_groups()


def destroy_layout() -> None:
    """Destroy Megatron's model-parallel groups (keeps the default group)."""
    parallel_state.destroy_model_parallel()
