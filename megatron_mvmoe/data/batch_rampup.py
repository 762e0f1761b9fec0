"""Batch-size ramp-up (`--rampup-batch-size START INCR SAMPLES`): each step's global batch
and microbatch count from Megatron-Core's num-microbatches calculator.

Meaning (Megatron-LM's): the global batch starts at START and grows by INCR each time
SAMPLES / ((GLOBAL - START) / INCR) more samples have been consumed, until it reaches
--global-batch-size; from then on it stays there.

Design choices:
- Megatron-Core 0.19.2 still accepts `rampup_batch_size` but ignores it (deprecated in
  `init_num_microbatches_calculator`); its calculator for a changing batch is
  `StepBatchsizeNumMicroBatchesCalculator` with a "SAMPLES:BATCH ..." schedule. The ramp is
  written as that schedule, with the thresholds where Megatron's former ramp-up calculator
  stepped (`int(consumed / (SAMPLES / increments))` reaches i at ceil(i SAMPLES /
  increments) consumed samples), in integers so no rounding moves a step.
- One calculator object per run, built here and owned by the training loop (Megatron's
  module-level one is never set: no global state). Without a ramp it is Megatron's
  ConstantNumMicroBatchesCalculator, so both cases take the same path.
- The calculator is a pure function of consumed samples, which checkpoints carry
  (ResumeState.consumed_samples): a resume mid-ramp lands on the same batch size and the
  same samples as the uninterrupted run.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from megatron.core.num_microbatches_calculator import (ConstantNumMicroBatchesCalculator,
                                                       NumMicroBatchesCalculator,
                                                       StepBatchsizeNumMicroBatchesCalculator)

from megatron_mvmoe.config.run_config import check_rampup


def rampup_schedule(rampup: Sequence[int], global_batch_size: int) -> str:
    """Megatron's step schedule ("SAMPLES:BATCH ...") of START INCR SAMPLES."""
    start, incr, samples = rampup
    increments = (global_batch_size - start) // incr
    if increments == 0 or samples == 0:
        return f"0:{global_batch_size}"
    steps = {}
    for i in range(increments + 1):
        threshold = -(-(i * samples) // increments)  # ceil(i * samples / increments)
        steps[threshold] = start + i * incr  # equal thresholds: the later batch wins
    return " ".join(f"{threshold}:{batch}" for threshold, batch in sorted(steps.items()))


def batch_calculator(rampup: Optional[Sequence[int]], global_batch_size: int,
                     micro_batch_size: int, data_parallel_size: int,
                     rank: int = 0) -> NumMicroBatchesCalculator:
    """Megatron's calculator for this run (call `.update(consumed_samples, True)` before each
    step, then `.get()` microbatches of `.get_current_global_batch_size()` samples)."""
    check_rampup(rampup, global_batch_size, micro_batch_size * data_parallel_size)
    if rampup is None:
        return ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size,
                                                 data_parallel_size, False, rank)
    return StepBatchsizeNumMicroBatchesCalculator(
        micro_batch_size, data_parallel_size, False, rank,
        rampup_schedule(rampup, global_batch_size))


def ramp_batches(rampup: Sequence[int], global_batch_size: int, steps: int) -> List[int]:
    """The global batch of each of the first `steps` steps (for plans and logs)."""
    calc = batch_calculator(rampup, global_batch_size, 1, 1)
    consumed, out = 0, []
    for _ in range(steps):
        calc.update(consumed, False)
        out.append(calc.get_current_global_batch_size())
        consumed += out[-1]
    return out
