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
- The reported loss lives on the last pipeline stage; it is averaged over the DP ranks and
  broadcast over the pipeline group, so every rank sees the same number.
- Before the optimizer step, one all-reduce over the world ORs "loss or grad norm is
  NaN/inf" with the preemption flags (stopping.py): a non-finite step is never applied,
  and every rank skips or stops at the same step.
"""

from __future__ import annotations

from functools import partial
import math
from typing import Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_batch_on_this_cp_rank

from megatron_mvmoe import platform
from megatron_mvmoe.data.run_data import to_device
from megatron_mvmoe.training.build import Trainer


def token_mean_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Megatron's loss-function contract: (mean token loss, {"lm loss": ...}) from the
    per-token losses [B, S/CP] GPTModel returns given labels (the sequence mean over CP)."""
    losses = output_tensor.float()
    mask = loss_mask.reshape(-1).float()
    loss_sum = torch.sum(losses.reshape(-1) * mask)
    cp_group = parallel_state.get_context_parallel_group()
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


def this_cp_rank_part(batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """This CP rank's load-balanced sequence chunks of a [B, S] microbatch (Megatron's split;
    attention is causal, so no mask travels)."""
    cp_group = parallel_state.get_context_parallel_group()
    if cp_group.size() == 1:
        return batch
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    split = get_batch_on_this_cp_rank({**{key: batch[key] for key in keys}, "cu_seqlens": None},
                                      is_hybrid_cp=False, cp_group=cp_group)
    return {key: split[key] for key in keys}


def forward_step(data_iterator: Iterator, model: torch.nn.Module):
    batch = this_cp_rank_part(to_device(next(data_iterator), platform.device()))
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                   labels=batch["labels"])
    return output, partial(token_mean_loss, batch["loss_mask"])


def _iterators(trainer: Trainer, make) -> List[Iterator]:
    """One iterator per model chunk (the interleaved schedule advances each separately)."""
    return [make() for _ in trainer.model]


def _mean_loss(trainer: Trainer, losses: List[Dict[str, torch.Tensor]]) -> float:
    """Mean microbatch loss, averaged over DP and broadcast over the pipeline group."""
    value = torch.zeros(1, dtype=torch.float64)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True) and losses:
        value[0] = torch.stack([d["lm loss"].double().cpu() for d in losses]).mean()
    value = value.to(platform.device())
    dp_group = parallel_state.get_data_parallel_group()
    dist.all_reduce(value, group=dp_group)
    value /= dist.get_world_size(dp_group)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    dist.broadcast(value, src=last, group=pp_group)
    return float(value.item())


def _run_schedule(trainer: Trainer, iterators, num_microbatches: int, forward_only: bool):
    run = trainer.run
    schedule = get_forward_backward_func()
    return schedule(forward_step_func=forward_step,
                    data_iterator=iterators if len(iterators) > 1 else iterators[0],
                    model=trainer.model if len(trainer.model) > 1 else trainer.model[0],
                    num_microbatches=num_microbatches, seq_length=trainer.model_section.seq_length,
                    micro_batch_size=run.training.micro_batch_size, forward_only=forward_only)


def _verdict_all_ranks(loss: float, grad_norm: float, stop_flags: Sequence[float]
                       ) -> Tuple[bool, List[float]]:
    """(non-finite anywhere, stop flags OR-ed over ranks): ONE all-reduce over the world, so
    every rank skips/stops at the same step whatever it saw locally."""
    bad = 0.0 if math.isfinite(loss) and math.isfinite(grad_norm) else 1.0
    values = torch.tensor([bad, *stop_flags], dtype=torch.float64, device=platform.device())
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    values = values.cpu().tolist()
    return values[0] > 0, values[1:]


def _assert_no_grad_scaler(optimizer) -> None:
    # prepare_grads() is called twice (here and inside step()): idempotent only without a
    # loss scaler, which would unscale twice. bf16/fp32 runs have none (fp16 is unsupported).
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        assert getattr(inner, "grad_scaler", None) is None, "fp16 loss scaling unsupported"


def _end_phase(trainer: Trainer, phase: str) -> None:
    if trainer.phase_hook is not None:
        trainer.phase_hook(phase)


def train_step(trainer: Trainer, iterators, num_microbatches: int,
               stop_flags: Sequence[float] = ()) -> Dict:
    """Forward/backward over the global batch; then, only when the loss and the gradient
    norm are finite on every rank, the optimizer and scheduler steps.

    Returns loss, grad_norm, lr, updated, nonfinite and `stop` (the stop flags OR-ed over
    all ranks). The gradient norm is computed before the update (one extra pass over the
    gradients) so a NaN/inf never reaches the weights or the Adam moments."""
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    trainer.optimizer.zero_grad()
    losses = _run_schedule(trainer, iterators, num_microbatches, forward_only=False)
    _end_phase(trainer, "backward")
    loss = _mean_loss(trainer, losses)
    _assert_no_grad_scaler(trainer.optimizer)
    trainer.optimizer.prepare_grads()
    grad_norm = float(trainer.optimizer.get_grad_norm() or 0.0)
    nonfinite, stop = _verdict_all_ranks(loss, grad_norm, stop_flags)
    metrics = {"loss": loss, "grad_norm": grad_norm, "nonfinite": nonfinite, "stop": stop,
               "lr": trainer.optimizer.param_groups[0]["lr"], "updated": False}
    if nonfinite:
        return metrics
    updated, _, _ = trainer.optimizer.step()
    _end_phase(trainer, "optimizer")  # grad norm, optimizer step and param all-gather
    trainer.scheduler.step(increment=1)
    metrics["updated"] = bool(updated)
    return metrics


@torch.no_grad()
def evaluate(trainer: Trainer, data, num_microbatches: int) -> Dict[str, float]:
    """Mean held-out loss per domain over `num_microbatches` microbatches per DP rank
    (the same ones every time). Reads only `trainer.run`, `.model_section` and `.model`, so a
    checkpoint opened without a trainer (toolkit/checkpoint.CheckpointModel) evaluates too."""
    for chunk in trainer.model:
        chunk.eval()
    results = {}
    try:
        for domain in data.domains:
            iterators = _iterators(trainer, partial(data.eval_iterator, domain))
            losses = _run_schedule(trainer, iterators, num_microbatches, forward_only=True)
            results[domain] = _mean_loss(trainer, losses)
    finally:
        for chunk in trainer.model:
            chunk.train()
    return results
