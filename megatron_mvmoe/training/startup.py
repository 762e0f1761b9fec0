"""Start-up: what a run trains with, built once, and the launcher around `pretrain`.

  argv -> RunConfig (config/flags.py) -> init_distributed -> start_up(run, world) = Start(
  run with the tokenizer's vocabulary, tokenizer, validated Megatron config) ->
  initialize_layout -> pretrain(start.run, pgs, start=start)

Design choices:
- `start_up` is a function of the run config: it returns a `Start` and never changes the
  run it is given (the caller's RunConfig stays as it was parsed or loaded). The tokenizer
  fixes the model's vocabulary (Megatron-LM conventions: `--tokenizer-type`, or the one
  saved beside preprocessed prefixes); the run that trains is then a copy with that
  vocabulary (`data/run_data.with_tokenizer_vocab`).
- The tokenizer is built once and handed to the data (data/run_data.RunData); the run is
  validated once (`models/build.validate_run`: the run config's fields, then the variant's
  and Megatron's on the Megatron config for the layout), and that config is the one the
  model is built from.
- `main()` is the console script (`mvmoe-pretrain`, `python -m
  megatron_mvmoe.training.pretrain`): exit status 0 finished, 2 user error / bad checkpoint
  / NaN stop (printed once, training/error_once.py), 3 stopped early for a requeue, 1 a
  collective timeout.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist

from megatron_mvmoe import log_noise, platform
from megatron_mvmoe.checkpointing.errors import CheckpointError
from megatron_mvmoe.checkpointing.publish import recover
from megatron_mvmoe.config.run_config import RunConfig
from megatron_mvmoe.config.transformer_config import MVMoETransformerConfig
from megatron_mvmoe.data.run_data import with_tokenizer_vocab
from megatron_mvmoe.models.build import validate_run
from megatron_mvmoe.platform.dist_ckpt_writer_queue import close_writer_processes
from megatron_mvmoe.training import error_once
from megatron_mvmoe.training.nonfinite import NonFiniteLoss
from megatron_mvmoe.training.stopping import (EXIT_REQUEUE, EXIT_USER_ERROR, STOPPED_MARKER,
                                              exit_cleanly_on_sigterm)
from megatron_mvmoe.training.weight_hash_check import ReplicaMismatch


@dataclass(frozen=True)
class Start:
    """What a run trains with, built once by `start_up`."""

    run: RunConfig
    """The run as it trains: the given one, or a copy with the tokenizer's vocabulary."""
    tokenizer: Optional[Any]
    """The run's tokenizer (Megatron-LM conventions), None for our directory layout."""
    config: MVMoETransformerConfig
    """The validated Megatron config of the run at its layout (the model is built from it)."""


def start_up(run: RunConfig, world_size: int) -> Start:
    """The run's tokenizer, the run with its vocabulary, and its validated Megatron config;
    `run` itself is left unchanged. ValueError (naming the field) for a bad run."""
    resolved, tokenizer = with_tokenizer_vocab(run)
    model = resolved.model
    config = validate_run(resolved, world_size, model.num_layers, model.num_experts)
    return Start(resolved, tokenizer, config)


def recover_saves(save: Optional[str], log_line: Callable[[str], None]) -> None:
    """Collective, before anything is loaded: finish or undo what interrupted saves left in
    --save (checkpointing/publish.py), and drop the stop marker of the run this one
    continues."""
    if save is None:
        return
    done = recover(save)
    if dist.get_rank() == 0 and os.path.exists(os.path.join(save, STOPPED_MARKER)):
        os.remove(os.path.join(save, STOPPED_MARKER))
    recovered = ([f".tmp_{n} (complete, manifest verified) published as {n}"
                  for n in done.published] +
                 [f".old_{n} (the copy kept during its re-save) renamed back to {n}"
                  for n in done.restored])
    if recovered:
        log_line(f"recovered an interrupted save in {save}: {'; '.join(recovered)}")
    if done.removed:
        log_line(f"removed {len(done.removed)} unfinished save(s) in {save}: {done.removed}")
    dist.barrier()


# ------------------------------------------------------------------------------ launcher
USER_ERRORS = (ValueError, CheckpointError, NonFiniteLoss, ReplicaMismatch)
"""What main() reports in one line with EXIT_USER_ERROR (anything else is a bug: traceback)."""

OnStep = Optional[Callable[[int, Any], None]]


def run_from_args(argv: Optional[Sequence[str]] = None, on_step: OnStep = None,
                  on_error: Optional[Callable[[Exception, object], None]] = None):
    """Parse, start torch.distributed, train. on_error(err, store) sees a USER_ERRORS error
    while the process group's store still exists (error_once.rank_error), then it is
    re-raised."""
    from megatron_mvmoe.config.flags import config_from_args

    return run_config(config_from_args(argv), on_step, on_error)


def run_config(run: RunConfig, on_step: OnStep = None,
               on_error: Optional[Callable[[Exception, object], None]] = None):
    """Start torch.distributed, build the Start, the layout's groups, then train; the
    RunResult of pretrain."""
    from megatron_mvmoe.launch import init_distributed
    from megatron_mvmoe.parallel import destroy_layout, initialize_layout
    from megatron_mvmoe.training.pretrain import pretrain

    log_noise.apply_logging_level(run.logging.logging_level)
    exit_cleanly_on_sigterm()
    try:
        platform.apply_cpu_patches()
        init_distributed(timeout_s=run.parallel.distributed_timeout_seconds)
        start = start_up(run, dist.get_world_size())
        model = start.run.model
        pgs = initialize_layout(start.run.parallel.layout(), model.num_layers,
                                model.num_experts,
                                timeout_s=run.parallel.distributed_timeout_seconds)
        result = pretrain(start.run, pgs, on_step=on_step, start=start)
        destroy_layout()
        return result
    except USER_ERRORS as err:
        if on_error is not None:
            on_error(err, error_once.default_store())
        raise
    except RuntimeError as err:
        if on_error is None or not error_once.is_collective_timeout(err):
            raise
        timeout = error_once.collective_timeout(
            err, run.parallel.distributed_timeout_seconds, run.training.save,
            dist.get_rank() if dist.is_initialized() else 0)
        on_error(timeout, None)  # no store: its host may be the rank that stopped
        raise timeout from None
    finally:
        close_writer_processes()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Optional[Sequence[str]] = None, on_step: OnStep = None) -> int:
    """Exit status: 0 finished, 2 user error / bad checkpoint / NaN stop, 3 (EXIT_REQUEUE)
    stopped early by a signal, --exit-duration-in-mins or --exit-interval after saving."""
    from megatron_mvmoe.config.flags import config_from_args

    try:
        run = config_from_args(argv)
    except ValueError as err:
        error_once.config_error(err)  # the same on every rank: rank 0 prints it
        return EXIT_USER_ERROR
    try:
        result = run_config(run, on_step=on_step, on_error=error_once.rank_error)
    except USER_ERRORS:
        return EXIT_USER_ERROR  # printed once by on_error
    except error_once.CollectiveTimeout:
        return 1  # printed by on_error: a failure of the job, not of its input
    if result.stopped:
        print(f"stopped early ({result.stopped}) at checkpoint {result.last_checkpoint}: exit "
              f"status {EXIT_REQUEUE} (requeue to continue)", file=sys.stderr, flush=True)
        return EXIT_REQUEUE
    return 0
