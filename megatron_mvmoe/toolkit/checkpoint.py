"""A run's model on this rank for a tool: from a trained checkpoint (on any layout it
reshards to) or freshly initialised from a preset or YAML.

Design choices:
- The run config comes from the checkpoint's own run_state.json, so a tool needs only the
  checkpoint path; the layout (TP/EP/...) and the data section may be overridden. The model
  is built by `models/build.build_model` (the chunks the trainer wraps, seeded the same
  way) and filled by `checkpointing/weights.load_weights` (verified, fingerprint checked,
  weights only): no DDP, optimizer or scheduler, and exactly the weights the trainer would
  resume with.
- The tokenizer is the run's: Megatron-LM flags in its data section, the tokenizer/ saved
  in its preprocessed directory, or one given to the tool.
- `tool_session` initialises torch.distributed from the launcher (torchrun, Slurm, MPI, or
  a single process) and Megatron's parallel state, and tears both down afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist

from megatron_mvmoe.checkpointing.directory import read_run_state, resolve_checkpoint
from megatron_mvmoe.checkpointing.fingerprint import run_fingerprint
from megatron_mvmoe.checkpointing.weights import load_weights
from megatron_mvmoe.config.model_section import ModelSection
from megatron_mvmoe.config.run_config import (RunConfig, config_from_dict, read_yaml,
                                              saved_config_from_dict, set_field)
from megatron_mvmoe.config.transformer_config import MVMoETransformerConfig
from megatron_mvmoe.models.build import build_model, validate_run
from megatron_mvmoe.platform.dist_ckpt_writer_queue import close_writer_processes


def stored_config(path: str, flag: str = "--load") -> Dict:
    """The raw run config a checkpoint (root or iter_* directory) was trained with."""
    raw = read_run_state(resolve_checkpoint(path)).get("config")
    if raw is None:
        raise ValueError(f"{flag} {path}: no stored run config. Fix: pass a checkpoint "
                         "written by the trainer, or --config with the YAML it was trained with")
    return copy.deepcopy(raw)


def checkpoint_run_config(path: str) -> RunConfig:
    """The RunConfig a checkpoint (root or iter_* directory) was trained with."""
    return saved_config_from_dict(stored_config(path))


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


def run_config(preset: Optional[str] = None, config_path: Optional[str] = None,
               checkpoint: Optional[str] = None, overrides: Optional[Dict] = None) -> RunConfig:
    """The one-rank run config (EP = TP = PP = 1) from a checkpoint's stored config, a YAML
    file, or a preset name, with `overrides` ({"section.field[.field]": value}) set before
    it is loaded and checked."""
    if checkpoint is not None:
        raw = stored_config(checkpoint, flag="--checkpoint")
    elif config_path is not None:
        raw = read_yaml(config_path)
    elif preset is not None:
        raw = {"model": {"preset": preset}}
    else:
        raise ValueError("no model given. Fix: pass --checkpoint, --config or --preset")
    for key, value in (overrides or {}).items():
        set_field(raw, key, value)
    # a checkpoint's config may be of an earlier version; a user's YAML must be exact
    run = saved_config_from_dict(raw) if checkpoint is not None else config_from_dict(raw)
    run.parallel.tp = run.parallel.pp = run.parallel.ep = run.parallel.etp = 1
    run.parallel.vpp = run.parallel.pp_layout = None  # a layout names the saved pp
    run.optimizer.use_distributed_optimizer = False
    return run


@contextlib.contextmanager
def tool_session(run: RunConfig) -> Iterator[object]:
    """Process group + Megatron parallel state for a tool; yields the pg collection."""
    from megatron_mvmoe import platform
    from megatron_mvmoe.data.run_data import resolve_tokenizer
    from megatron_mvmoe.launch import init_distributed
    from megatron_mvmoe.parallel import destroy_layout, initialize_layout

    platform.apply_cpu_patches()
    started = not dist.is_initialized()
    if started:
        init_distributed(timeout_s=run.parallel.distributed_timeout_seconds)
    try:
        resolve_tokenizer(run)
        model = run.model
        validate_run(run, dist.get_world_size(), model.num_layers, model.num_experts)
        yield initialize_layout(run.parallel.layout(), model.num_layers, model.num_experts)
        destroy_layout()
    finally:
        close_writer_processes()
        if started and dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class CheckpointModel:
    """A checkpoint's model on this rank, for inference or evaluation. Has the `run`,
    `model_section` and `model` chunk list `training/step.evaluate` reads from a Trainer."""

    run: RunConfig
    model_section: ModelSection
    """= run.model (the name training/step.evaluate reads)."""
    model: List[torch.nn.Module]
    """This rank's unwrapped GPTModel chunks (one per virtual pipeline stage)."""
    step: int
    """The training step the checkpoint was saved at."""


def _load_into(chunks: List[torch.nn.Module], run: RunConfig, path: str) -> int:
    """Collective: the checkpoint's weights into `chunks`; returns the saved step."""
    meta = load_weights(chunks, path, run_fingerprint(run),
                        allow_unverified=run.training.ckpt_allow_unverified)
    return int(meta["step"])


def load_model(run: RunConfig, path: str, pg_collection) -> CheckpointModel:
    """Collective: build the run's model on the current layout and load the checkpoint's
    weights (no optimizer)."""
    chunks = build_model(run, pg_collection)
    step = _load_into(chunks, run, path)
    return CheckpointModel(run=run, model_section=run.model, model=chunks, step=step)


@dataclass
class OpenModel:
    """A whole model on this rank, in eval mode, for the analyses."""

    model: torch.nn.Module
    """The GPTModel (eval mode)."""
    run: RunConfig
    config: MVMoETransformerConfig
    """The model's full config (`model.config`)."""
    source: str
    """'checkpoint:<path>' or 'fresh-init(seed=...)'."""


def open_model(run: RunConfig, pg_collection, checkpoint: Optional[str] = None) -> OpenModel:
    """Collective: build the run's model (one chunk) and load `checkpoint`'s weights if
    given."""
    chunks = build_model(run, pg_collection)
    if len(chunks) != 1:
        raise ValueError("analysis needs the whole model on one rank (pp = vpp = 1)")
    source = f"fresh-init(seed={run.training.seed})"
    if checkpoint is not None:
        _load_into(chunks, run, checkpoint)
        source = f"checkpoint:{os.path.abspath(checkpoint)}"
    model = chunks[0].eval()
    return OpenModel(model, run, model.config, source)


def run_tokenizer(run: RunConfig):
    """The tokenizer of the run: Megatron-LM flags, or the preprocessed directory's."""
    from megatron_mvmoe.data.indexed import read_meta
    from megatron_mvmoe.data.run_data import build_run_tokenizer
    from megatron_mvmoe.data.tokenize import load_tokenizer

    tokenizer = build_run_tokenizer(run)
    if tokenizer is not None:
        return tokenizer
    path = run.data.path
    if isinstance(path, str) and os.path.isdir(os.path.join(path, "tokenizer")):
        return load_tokenizer(os.path.join(path, "tokenizer"),
                              read_meta(path)["tokenizer"]["kind"])
    # a relative data.path (the main job's) is read from where the tool runs: say where
    relative = isinstance(path, str) and not os.path.isabs(path)
    where = f", read from {os.getcwd()}," if relative else ""
    run_there = "run the tool in the directory the run trained in, or " if relative else ""
    raise ValueError(f"tokenizer: the checkpoint's run has none on record (data.path {path!r}"
                     f"{where} holds no tokenizer/). Fix: {run_there}pass --tokenizer-type "
                     "with --tokenizer-model / --vocab-file --merge-file")
