"""A trained checkpoint, rebuilt for inference or evaluation on the current layout.

Design choices:
- The run config comes from the checkpoint's own run_state.json, so a tool needs only the
  checkpoint path; the layout (TP/EP/...) and the data section may be overridden. The model
  is built by the trainer's own `build_trainer` and filled by `load_checkpoint` (weights
  only), so a tool sees exactly the weights the trainer would resume with, on any layout
  dist-checkpointing can reshard to.
- The tokenizer is the run's: Megatron-LM flags in its data section, the tokenizer/ saved
  in its preprocessed directory, or one given to the tool.
- `tool_session` initialises torch.distributed from the launcher (torchrun, Slurm, MPI, or
  a single process) and Megatron's parallel state, and tears both down afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Dict, Iterator, Optional

import torch.distributed as dist

from megatron_mvmoe.training import checkpoint as ckpt
from megatron_mvmoe.run_config import RunConfig, saved_config_from_dict


def checkpoint_run_config(path: str) -> RunConfig:
    """The RunConfig a checkpoint (root or iter_* directory) was trained with."""
    meta = ckpt.read_run_state(ckpt.resolve_checkpoint(path))
    return saved_config_from_dict(copy.deepcopy(meta["config"]))


def with_layout(run: RunConfig, parallel: Optional[Dict] = None) -> RunConfig:
    """The run with a new layout (tp/pp/ep/etp) and no saving, loading or logging files."""
    for name, value in (parallel or {}).items():
        if value is not None:
            setattr(run.parallel, name, value)
    run.training.save = None
    run.training.load = None
    run.training.warm_start_from = None
    run.logging.run_dir = None
    run.logging.tensorboard = False
    run.logging.wandb_project = None
    return run


@contextlib.contextmanager
def tool_session(run: RunConfig) -> Iterator[object]:
    """Process group + Megatron parallel state for a tool; yields the pg collection."""
    from megatron_mvmoe import platform
    from megatron_mvmoe.launch import init_distributed
    from megatron_mvmoe.parallel import destroy_layout, initialize_layout
    from megatron_mvmoe.training.data import resolve_tokenizer

    platform.apply_cpu_patches()
    started = not dist.is_initialized()
    if started:
        init_distributed(timeout_s=run.parallel.distributed_timeout_seconds)
    try:
        resolve_tokenizer(run)
        shape = run.model
        run.validate(dist.get_world_size(), shape.num_layers, shape.num_experts)
        yield initialize_layout(run.parallel.layout(), shape.num_layers, shape.num_experts)
        destroy_layout()
    finally:
        ckpt.close_writer_processes()
        if started and dist.is_initialized():
            dist.destroy_process_group()


def load_trainer(run: RunConfig, path: str, pg_collection):
    """Build the run's model on the current layout and load the checkpoint's weights."""
    from megatron_mvmoe.training.build import build_trainer

    trainer = build_trainer(run, pg_collection)
    state = ckpt.load_checkpoint(trainer, path, load_optimizer=False)
    return trainer, state


def checkpoint_step(path: str) -> int:
    return int(ckpt.read_run_state(ckpt.resolve_checkpoint(path))["step"])


def run_tokenizer(run: RunConfig):
    """The tokenizer of the run: Megatron-LM flags, or the preprocessed directory's."""
    from megatron_mvmoe.data.indexed import read_meta
    from megatron_mvmoe.data.tokenize import load_tokenizer
    from megatron_mvmoe.training.data import build_run_tokenizer

    tokenizer = build_run_tokenizer(run)
    if tokenizer is not None:
        return tokenizer
    path = run.data.path
    if isinstance(path, str) and os.path.isdir(os.path.join(path, "tokenizer")):
        return load_tokenizer(os.path.join(path, "tokenizer"),
                              read_meta(path)["tokenizer"]["kind"])
    raise ValueError("tokenizer: the checkpoint's run has none on record (data.path "
                     f"{path!r} holds no tokenizer/). Fix: --tokenizer-type with "
                     "--tokenizer-model / --vocab-file --merge-file")
