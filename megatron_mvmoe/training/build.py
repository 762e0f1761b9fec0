"""Everything a training run holds, built in order: config -> model chunks
(`models/build.build_model`, the one path every tool shares) -> DDP -> distributed
optimizer -> LR scheduler.

Design choices:
- All engine pieces are Megatron-Core's own: `DistributedDataParallel` (grad buffers and
  the DP reduce), `get_megatron_optimizer` (ZeRO-1 distributed optimizer, fp32 main params
  with bf16 models, grad clipping), `OptimizerParamScheduler` (linear warmup then cosine to
  min_lr), `finalize_model_grads` as `config.finalize_model_grads_func` (without it the
  schedule does neither the DP grad sync nor the expert-bias update).
- Everything lives in the returned `Trainer` object; nothing module-level is mutated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable, List, Optional

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.layer_wise_optimizer import (LayerWiseDistributedOptimizer,
                                                          tag_params_for_buffer_routing)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_mvmoe import platform
from megatron_mvmoe.config.model_section import ModelSection
from megatron_mvmoe.config.run_config import RunConfig
from megatron_mvmoe.config.transformer_config import MVMoETransformerConfig
from megatron_mvmoe.models.build import build_model
from megatron_mvmoe.models.fast_paths import FastPath, ddp_fields
from megatron_mvmoe.models.provider import model_fast_paths, target_for
from megatron_mvmoe.training.adam_impl import apply_adam_impl
from megatron_mvmoe.training.schedule_rule import scheduler_switches


@dataclass
class Trainer:
    """The model, optimizer and scheduler of one run on this rank."""

    run: RunConfig
    config: MVMoETransformerConfig
    pg_collection: object
    model: List[DistributedDataParallel]
    """One DDP-wrapped GPTModel per virtual pipeline stage."""
    optimizer: object
    scheduler: OptimizerParamScheduler
    phase_hook: Optional[Callable[[str], None]] = None
    """Called by the step at the end of each phase ("backward", "optimizer"), e.g. by the
    memory census to split a step's resident peak by phase; None: nothing is called."""

    @property
    def model_section(self) -> ModelSection:
        """The model (run.model: resolved when the config was loaded)."""
        return self.run.model

    def unwrapped(self) -> List[torch.nn.Module]:
        return [chunk.module for chunk in self.model]


def run_fast_paths(run: RunConfig) -> List[FastPath]:
    """The fast-path decisions for this run on this machine (models/fast_paths.py)."""
    return model_fast_paths(run.model, target_for(not platform.is_cuda(), run.model),
                            run.parallel.etp, run.optimizer)


def ddp_config(run: RunConfig) -> DistributedDataParallelConfig:
    """Megatron's DDP config of the run. check_for_nan_in_grad is off because the loop's own
    check (training/nonfinite.py: one all-reduce of loss and grad norm before the optimizer
    step) does what Megatron-LM's --check-for-nan-in-loss-and-grad does, and more."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=run.optimizer.grad_reduce_in_fp32,
        use_distributed_optimizer=_ddp_shards(run.optimizer),
        num_distributed_optimizer_instances=run.parallel.distributed_optimizer_instances,
        check_for_nan_in_grad=False, **_fsdp_fields(run.optimizer),
        **ddp_fields(run_fast_paths(run)))


def _fsdp_fields(o) -> dict:
    """Megatron-FSDP's DDP-config fields (the strategy always, as Megatron-LM passes it; DDP
    does not read it). On gloo the gradient pre-division is not fused into the reduction: the
    fused op is NCCL's premul-sum (`_make_nccl_premul_sum`), which gloo lacks; unfused,
    Megatron-FSDP scales the gradients and then SUM-reduces them."""
    fields = dict(data_parallel_sharding_strategy=o.data_parallel_sharding_strategy)
    if o.megatron_fsdp:
        fields.update(use_megatron_fsdp=True, gradient_reduce_div_fusion=platform.is_cuda())
    return fields


def _ddp_shards(o) -> bool:
    """Whether DDP reduce-scatters into a sharded layout: the distributed optimizer's (which
    Megatron-FSDP implies, as in Megatron-LM), or layer-wise Muon's shard-aligned one;
    layer-wise Muon's legacy path all-reduces one unsharded buffer (Megatron-LM's
    wrap_model_chunks_with_ddp)."""
    if o.layer_wise:
        return o.use_layer_wise_param_layout
    return _distributed_optimizer(o)


def _distributed_optimizer(o) -> bool:
    """Megatron's distributed optimizer: asked for, or implied by Megatron-FSDP (as in
    Megatron-LM)."""
    return o.use_distributed_optimizer or o.megatron_fsdp


def _wrap_ddp(config, chunks, run: RunConfig, pg_collection,
              ddp: DistributedDataParallelConfig) -> List[DistributedDataParallel]:
    if run.optimizer.megatron_fsdp:
        return _wrap_megatron_fsdp(config, chunks, ddp, pg_collection)
    layouts = [None] * len(chunks)
    if run.optimizer.layer_wise and run.optimizer.use_layer_wise_param_layout:
        layouts = _layer_wise_layouts(chunks, ddp, pg_collection)
    # Bucketing is pointless for non-first virtual chunks (Megatron does the same).
    return [DistributedDataParallel(config=config, ddp_config=ddp, module=chunk,
                                    disable_bucketing=index > 0, full_param_layout=layout)
            for index, (chunk, layout) in enumerate(zip(chunks, layouts))]


def _no_sync_func(model, overlap_grad_reduce: bool):
    """The schedule's no_sync, set as Megatron-LM's training.py sets it: only when the
    gradient reduction overlaps the backward. Without the overlap, DDP's hooks ignore
    no_sync, but Megatron-FSDP's 'optim' and 'no_shard' reduce in the last microbatch's
    backward hooks once a no_sync has ended, and finish_grad_sync reduces again: 'optim'
    reduce-scattered each gradient twice (grad norm 0.83 instead of DDP's 1.08 in step 1;
    tests/training/test_megatron_fsdp.py)."""
    if not overlap_grad_reduce:
        return None
    no_sync = [chunk.no_sync for chunk in model]
    return no_sync[0] if len(no_sync) == 1 else no_sync


def _wrap_megatron_fsdp(config, chunks, ddp, pg_collection) -> list:
    """Megatron-LM's get_model with --use-megatron-fsdp: Megatron-Core's FSDP adapter over
    each chunk, on this rank's device (the CPU here; platform/megatron_fsdp_cpu.py)."""
    device = None if platform.is_cuda() else torch.device("cpu")
    return [FullyShardedDataParallel(config=config, ddp_config=ddp, module=chunk,
                                     disable_bucketing=index > 0, device=device,
                                     pg_collection=pg_collection)
            for index, chunk in enumerate(chunks)]


def _layer_wise_layouts(chunks, ddp, pg_collection) -> list:
    """Layer-wise Muon's shard-aligned parameter layout per chunk, as Megatron-LM's
    wrap_model_chunks_with_ddp computes it: Muon's matrices tagged into their own buffer,
    each whole matrix in one data-parallel rank's shard."""
    tag_params_for_buffer_routing(chunks)
    dp = pg_collection.intra_dp_cp.size()
    expert_dp = pg_collection.intra_expt_dp.size()
    pp_rank = pg_collection.pp.rank()
    return [LayerWiseDistributedOptimizer.compute_full_param_layout(
        [p for p in chunk.parameters() if p.requires_grad],
        None if index > 0 or pp_rank > 0 else ddp.bucket_size, dp, ddp,
        expert_data_parallel_world_size=expert_dp) for index, chunk in enumerate(chunks)]


def optimizer_config(run: RunConfig, config) -> OptimizerConfig:
    """Megatron's optimizer config of the run (Adam or Muon; precision from the model
    config; the parameter all-gather's overlap from the DDP config). Muon's fields reach
    OptimizerConfig as Megatron-LM's arguments.py passes them."""
    o = run.optimizer
    return OptimizerConfig(
        optimizer="muon" if o.optimizer == "dist_muon" else o.optimizer,
        use_layer_wise_distributed_optimizer=o.layer_wise,
        muon_momentum=o.muon_momentum, muon_scale_mode=o.muon_scale_mode,
        muon_extra_scale_factor=o.muon_extra_scale_factor, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
        clip_grad=o.clip_grad, bf16=config.bf16, fp16=config.fp16,
        initial_loss_scale=o.initial_loss_scale, loss_scale=o.loss_scale,
        min_loss_scale=o.min_loss_scale, loss_scale_window=o.loss_scale_window,
        hysteresis=o.hysteresis,
        params_dtype=config.params_dtype,
        use_distributed_optimizer=_distributed_optimizer(o) and not o.layer_wise,
        # DDP's value, as OptimizerConfig asks and Megatron-LM passes it: layer-wise Muon
        # reads this copy; with it off (DDP's on, on a GPU) Muon all-gathers the parameters
        # itself after each step, besides DDP's overlapped all-gather
        overlap_param_gather=ddp_config(run).overlap_param_gather)


def _optimizer(run: RunConfig, config, model) -> object:
    optimizer = get_megatron_optimizer(optimizer_config(run, config), model)
    apply_adam_impl(optimizer, run.optimizer.torch_adam_impl)  # checkpoint loads re-apply it
    return optimizer


def _scheduler(run: RunConfig, optimizer) -> OptimizerParamScheduler:
    o, t = run.optimizer, run.training
    # train_iters = 0 (save/evaluate the initial model) still needs a valid schedule.
    decay = max(o.decay_iters or t.train_iters, o.warmup_iters + 1)
    # A fractional warmup ends mid-step, as in Megatron-LM's sample-counting scheduler: the
    # LR is a function of step / warmup and (step - warmup) / (decay - warmup), ratios
    # that counting in samples (all three x global batch) leaves unchanged.
    warmup = o.warmup_iters if o.warmup_fraction is None else o.warmup_fraction * decay
    return OptimizerParamScheduler(
        optimizer, init_lr=o.init_lr, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=decay, lr_decay_style=o.lr_decay_style, start_wd=o.weight_decay,
        end_wd=o.weight_decay, wd_incr_steps=decay, wd_incr_style="constant",
        **scheduler_switches(t))


def build_trainer(run: RunConfig, pg_collection,
                  config: Optional[MVMoETransformerConfig] = None) -> Trainer:
    """Build this rank's model chunks, DDP wrappers, optimizer and scheduler."""
    chunks = build_model(run, pg_collection, config)  # seeded, on the device
    config = chunks[0].config
    ddp = ddp_config(run)
    overlap = ddp.overlap_grad_reduce  # before Megatron-FSDP turns it on for its own use
    model = _wrap_ddp(config, chunks, run, pg_collection, ddp)
    # The schedule calls this after the last backward: DP grad sync, TP/PP embedding and
    # layer-norm grad reductions, and the expert-bias update.
    config.finalize_model_grads_func = partial(finalize_model_grads)
    config.no_sync_func = _no_sync_func(model, overlap)
    optimizer = _optimizer(run, config, model)
    if config.fp16 or run.optimizer.loss_scale:
        # the schedule scales each loss before its backward by the optimizer's grad scaler
        # (Megatron-LM's rule; without a scaler, as fp32's plain optimizer, the scale is 1)
        config.grad_scale_func = optimizer.scale_loss
    scheduler = _scheduler(run, optimizer)
    return Trainer(run=run, config=config, pg_collection=pg_collection,
                   model=model, optimizer=optimizer, scheduler=scheduler)
