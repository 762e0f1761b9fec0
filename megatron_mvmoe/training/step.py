"""One optimizer step and one evaluation, through Megatron's pipeline schedules.

Design choices:
- `get_forward_backward_func` picks no-pipelining, 1F1B or interleaved 1F1B from the
  parallel state; our `forward_step` only moves a microbatch to the device and returns the
  model output with a loss function (Megatron's contract).
- The loss function returns (mean token loss, {"lm loss": loss}); the schedule divides by
  the number of microbatches, DDP averages over data-parallel ranks, so the loss (and the
  gradients) are the global-batch mean whatever the layout: the basis of layout parity.
- Context parallelism: each microbatch is split per CP rank by Megatron's
  `get_batch_on_this_cp_rank` (load-balanced chunks; RoPE slices its own table). A CP rank's
  loss is its token-loss sum over the token count all-reduced over the CP group; Megatron's
  schedule multiplies it by CP and DDP averages the gradients over DP x CP, so they are
  those of the whole sequence's mean.
- `training.calculate_per_token_loss` (Megatron-LM's --calculate-per-token-loss): the loss
  function returns Megatron-LM's (masked loss sum, token count, {"lm loss": [sum, count]});
  the schedule leaves the sum undivided, DDP does not average over DP, and
  finalize_model_grads divides the gradients once by the global batch's token count, so
  the gradients are those of the token mean over the whole global batch.
- The reported loss lives on the last pipeline stage: (numerator, denominator) over the
  DP x CP ranks, i.e. the mean of the microbatch means, or with per-token loss the global
  token mean; it is broadcast over the pipeline group, so every rank sees the same number.
- Process groups come from the run's `pg_collection` (Megatron's ProcessGroupCollection),
  passed in, and are handed to Megatron's schedule too: nothing here reads
  `parallel_state`, so a step runs on whatever groups its caller built.
- Before the optimizer step, one all-reduce over the world ORs "loss or grad norm is
  NaN/inf" with the preemption flags (stopping.py): a non-finite step is never applied,
  and every rank skips or stops at the same step. With fp16 the check sees the loss only:
  scaled gradients overflow by design, and Megatron's optimizer step skips such an update
  and lowers the loss scale (`_scaled_update`).
"""

from __future__ import annotations

from functools import partial
import math
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.utils import is_pp_last_stage
from megatron.core.utils import get_batch_on_this_cp_rank, get_model_config

from megatron_mvmoe import platform
from megatron_mvmoe.data.run_data import to_device
from megatron_mvmoe.training.build import Trainer
from megatron_mvmoe.training.grad_norm_once import grad_norm_reused


def token_mean_loss(cp_group: dist.ProcessGroup, loss_mask: torch.Tensor,
                    output_tensor: torch.Tensor):
    """Megatron's loss-function contract: (mean token loss, {"lm loss": ...}) from the
    per-token losses [B, S/CP] GPTModel returns given labels (the sequence mean over the
    context-parallel group `cp_group`)."""
    losses = output_tensor.float()
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses.reshape(-1) * mask)
    if cp_group.size() == 1:
        loss = loss_sum / mask.sum().clamp(min=1)
        return loss, {"lm loss": loss.detach().clone()}
    # Sum and count over the whole sequence (no autograd through the all-reduce: each rank
    # differentiates its own tokens' share of the sequence mean).
    sum_and_count = torch.stack([loss_sum.detach(), mask.sum()])
    dist.all_reduce(sum_and_count, group=cp_group)
    count = sum_and_count[1].clamp(min=1)
    loss = loss_sum / count  # the schedule scales it by CP (schedules.forward_step)
    return loss, {"lm loss": (sum_and_count[0] / count).clone()}


def token_sum_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron-LM's per-token loss contract (pretrain_gpt.loss_func): (masked loss sum,
    token count, {"lm loss": [sum, count]}) of the per-token losses [B, S/CP] (a CP rank
    sums its own tokens; finalize_model_grads counts over DP x CP)."""
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(output_tensor.float().reshape(-1) * mask)
    count = mask.sum()
    return loss_sum, count.detach().to(torch.int), {"lm loss": torch.stack(
        [loss_sum.detach(), count.detach()])}


def this_cp_rank_part(batch: Dict[str, torch.Tensor], cp_group: dist.ProcessGroup
                      ) -> Dict[str, torch.Tensor]:
    """This CP rank's load-balanced sequence chunks of a [B, S] microbatch over `cp_group`
    (Megatron's split; attention is causal, so no mask travels)."""
    if cp_group.size() == 1:
        return batch
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    split = get_batch_on_this_cp_rank({**{key: batch[key] for key in keys}, "cu_seqlens": None},
                                      is_hybrid_cp=False, cp_group=cp_group)
    return {key: split[key] for key in keys}


def forward_step(cp_group: dist.ProcessGroup, per_token: bool, data_iterator: Iterator,
                 model: torch.nn.Module):
    """Megatron's forward-step contract once `cp_group` and `per_token` (the run's
    calculate_per_token_loss) are bound (functools.partial)."""
    batch = this_cp_rank_part(to_device(next(data_iterator), platform.device()), cp_group)
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"])
    if per_token:
        return output, partial(token_sum_loss, batch["loss_mask"])
    return output, partial(token_mean_loss, cp_group, batch["loss_mask"])


def _iterators(trainer: Trainer, make) -> List[Iterator]:
    """One iterator per model chunk (the interleaved schedule advances each separately)."""
    return [make() for _ in trainer.model]


def _numerator_denominator(record: torch.Tensor) -> torch.Tensor:
    """[loss sum, token count] of a per-token record; [mean, 1] of a microbatch mean."""
    record = record.double().cpu().reshape(-1)
    return record if record.numel() == 2 else torch.cat([record, torch.ones(1).double()])


def _mean_loss(pgs, losses: List[Dict[str, torch.Tensor]]) -> float:
    """The reported loss: summed (numerator, denominator) over the microbatches and the DP x
    CP ranks (a CP rank's microbatch mean is already the whole sequence's, counted once per
    CP rank on both sides), broadcast over the pipeline group."""
    value = torch.zeros(2, dtype=torch.float64)
    if is_pp_last_stage(pgs.pp) and losses:
        value = torch.stack([_numerator_denominator(d["lm loss"]) for d in losses]).sum(0)
    value = value.to(platform.device())
    dist.all_reduce(value, group=pgs.dp_cp)
    mean = value[:1] / value[1:].clamp(min=1)
    last_stage = dist.get_global_rank(pgs.pp, pgs.pp.size() - 1)
    dist.broadcast(mean, src=last_stage, group=pgs.pp)
    return float(mean.item())


def _schedule_groups(model_chunks, pgs) -> Dict:
    """The groups Megatron's schedules take explicitly: the collection and, with a
    pipeline, a P2P communicator over its PP group (they take both or neither)."""
    if pgs.pp.size() == 1:
        return {"pg_collection": pgs}
    return {"pg_collection": pgs,
            "p2p_communicator": P2PCommunicator(pp_group=pgs.pp,
                                                config=get_model_config(model_chunks[0]))}


def _run_schedule(trainer: Trainer, pgs, iterators, num_microbatches: int,
                  forward_only: bool):
    run = trainer.run
    schedule = get_forward_backward_func(pp_size=pgs.pp.size(), vp_size=run.parallel.vpp)
    per_token = run.training.calculate_per_token_loss
    return schedule(forward_step_func=partial(forward_step, pgs.cp, per_token),
                    data_iterator=iterators if len(iterators) > 1 else iterators[0],
                    model=trainer.model if len(trainer.model) > 1 else trainer.model[0],
                    num_microbatches=num_microbatches,
                    seq_length=trainer.model_section.seq_length,
                    micro_batch_size=run.training.micro_batch_size, forward_only=forward_only,
                    **_schedule_groups(trainer.model, pgs))


def _verdict_all_ranks(loss: float, grad_norm: float, stop_flags: Sequence[float]
                       ) -> Tuple[bool, List[float]]:
    """(non-finite anywhere, stop flags OR-ed over ranks): ONE all-reduce over the world, so
    every rank skips/stops at the same step whatever it saw locally."""
    bad = 0.0 if math.isfinite(loss) and math.isfinite(grad_norm) else 1.0
    values = torch.tensor([bad, *stop_flags], dtype=torch.float64, device=platform.device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    values = values.cpu().tolist()
    return values[0] > 0, values[1:]


def _loss_scaling(optimizer) -> bool:
    """fp16: Megatron's optimizers carry a grad scaler (bf16/fp32 ones have none)."""
    return any(getattr(inner, "grad_scaler", None) is not None
               for inner in getattr(optimizer, "chained_optimizers", [optimizer]))


def _scaled_update(trainer: Trainer, metrics: Dict) -> Dict:
    """fp16's update (Megatron-LM's train_step): optimizer.step() unscales the gradients and
    on an inf/NaN among them skips the update and lowers the loss scale, an expected
    skipped iteration (the first steps from 2**32), not an error. It runs prepare_grads,
    which updates the scale, so that runs once: here, not before as for bf16/fp32."""
    updated, grad_norm, _ = trainer.optimizer.step()
    _end_phase(trainer, "optimizer")
    if updated:
        trainer.scheduler.step(increment=1)
    metrics.update(updated=bool(updated), loss_scale_overflow=not updated,
                   grad_norm=float(grad_norm or 0.0))
    return metrics


def _end_phase(trainer: Trainer, phase: str) -> None:
    if trainer.phase_hook is not None:
        trainer.phase_hook(phase)


def train_step(trainer: Trainer, iterators, num_microbatches: int,
               stop_flags: Sequence[float] = ()) -> Dict:
    """Forward/backward over the global batch; then, only when the loss and the gradient
    norm are finite on every rank, the optimizer and scheduler steps.

    Returns loss, grad_norm, lr, updated, nonfinite and `stop` (the stop flags OR-ed over
    all ranks). The gradient norm is computed before the update so a NaN/inf never reaches
    the weights or the Adam moments; Megatron's clipping reuses it (grad_norm_once.py)."""
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    pgs = trainer.pg_collection
    losses = _run_schedule(trainer, pgs, iterators, num_microbatches, forward_only=False)
    _end_phase(trainer, "backward")
    loss = _mean_loss(pgs, losses)
    scaled = _loss_scaling(trainer.optimizer)
    norm = None
    if not scaled:  # prepare_grads is idempotent without a loss scaler
        trainer.optimizer.prepare_grads()
        norm = trainer.optimizer.get_grad_norm()
    grad_norm = float(norm or 0.0)
    nonfinite, stop = _verdict_all_ranks(loss, grad_norm, stop_flags)
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": nonfinite, "stop": stop,
               "lr": trainer.optimizer.param_groups[0]["lr"], "updated": False}
    if nonfinite:
        return metrics
    if scaled:
        return _scaled_update(trainer, metrics)
    with grad_norm_reused(trainer.optimizer, norm):  # clipping reads it: no second pass
        updated, _, _ = trainer.optimizer.step()
    _end_phase(trainer, "optimizer")  # grad norm, optimizer step and param all-gather
    trainer.scheduler.step(increment=1)
    metrics["updated"] = bool(updated)
    return metrics


@torch.no_grad()
def evaluate(trainer: Trainer, data, num_microbatches: int, pg_collection) -> Dict[str, float]:
    """Mean held-out loss per domain over `num_microbatches` microbatches per DP rank
    (the same ones every time), on the groups of `pg_collection`. Reads only
    `trainer.run`, `.model_section` and `.model`, so a checkpoint opened without a trainer
    (toolkit/checkpoint.CheckpointModel) evaluates too."""
    for chunk in trainer.model:
        chunk.eval()
    results = {}
    try:
        for domain in data.domains:
            iterators = _iterators(trainer, partial(data.eval_iterator, domain))
            losses = _run_schedule(trainer, pg_collection, iterators, num_microbatches,
                                   forward_only=True)
            results[domain] = _mean_loss(pg_collection, losses)
    finally:
        for chunk in trainer.model:
            chunk.train()
    return results
