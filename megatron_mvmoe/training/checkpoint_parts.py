"""What a checkpoint holds, as named parts, each with `state_dict()` / `load_state_dict()`
(the Stateful protocol of torch.distributed.checkpoint, as torchtitan's checkpointer keeps
its model, optimizers, schedulers, data loader and train state); checkpoint.py saves and
loads by iterating them (`checkpoint_parts(...)`, one dict in load order), leaving out the
parts a way of loading excludes (`EXCLUDE_FROM_LOADING`, torchtitan's
`exclude_from_loading`).

  part         lives in                               load
  model        dist-checkpointing tensors model<i>    strict, every key
  optimizer    dist-checkpointing tensors optimizer   paired by structure (resume_groups)
  scheduler    run_state.json "scheduler"             the schedule rule (schedule_rule.py)
  rng          rng/rank_<r>.pt (tracker states too)   same world size and layout, else
                                                      reseeded from (seed, step)
  position     run_state.json step, consumed_samples, gamma, skipped_iters
  run metadata run_state.json format, world_size, layout, optimizer_format, fingerprint,
               config, ckpt_format                    read (checked by checkpointing/)

Design choices:
- The on-disk format is the one checkpoints have always had (run_state.json is the union
  of the JSON parts' keys, which are disjoint): older checkpoints, 0.16.1 ones included,
  load unchanged.
- The tensor parts return Megatron *sharded* state dicts: the optimizer's is built from
  the model's (`sharded_state_dict(model_state, ...)`), so both go to one
  dist-checkpointing call, which reshards them to the layout that loads them.
- A JSON part missing from run_state.json is one CheckpointError naming the part, the
  keys and the fix (`read_part`); keys added after a format was first written are
  optional, with the value older checkpoints imply.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Optional, Protocol, Sequence, Tuple, runtime_checkable

import numpy as np
import torch
from megatron.core import tensor_parallel

from megatron_mvmoe.checkpointing.directory import FORMAT, RUN_STATE
from megatron_mvmoe.checkpointing.errors import CheckpointError
from megatron_mvmoe.checkpointing.weights import model_sharded_state_dict, set_model_weights
from megatron_mvmoe.platform import device_rng_state, is_cuda, set_device_rng_state
from megatron_mvmoe.training.resume_groups import align_saved_groups, apply_schedule_rule
from megatron_mvmoe.training.schedule_rule import restore_scheduler


TENSORS, RANK_FILE = "tensors", "rng/rank_<r>.pt"
"""Where a part lives (its `store`), with RUN_STATE: the one dist-checkpointing call, one
torch file per rank, keys of run_state.json."""


@runtime_checkable
class Stateful(Protocol):
    """One named part of a checkpoint."""

    name: str
    store: str

    def state_dict(self) -> Dict: ...

    def load_state_dict(self, state: Dict) -> None: ...


class JsonPart(Stateful, Protocol):
    """A part stored as keys of run_state.json."""

    required: Tuple[str, ...]
    """Keys every checkpoint of this format has."""
    optional: Tuple[str, ...]
    """Keys added later; absent in older checkpoints (the part supplies their default)."""
    fix: str
    """What to do when the part is missing."""


def read_part(part: JsonPart, run_state: Dict, directory: str) -> None:
    """Load `part` from the run_state.json of `directory`: one error naming the part when
    one of its required keys is absent."""
    missing = [key for key in part.required if key not in run_state]
    if missing:
        raise CheckpointError(f"{directory}: {RUN_STATE} has no {part.name} part (missing "
                              f"{', '.join(missing)}). Fix: {part.fix}")
    part.load_state_dict({k: run_state[k] for k in part.required + part.optional
                          if k in run_state})


def run_state_of(parts: Sequence[JsonPart]) -> Dict:
    """run_state.json: the union of the parts' states (their keys are disjoint)."""
    merged: Dict = {}
    for part in parts:
        state = part.state_dict()
        assert set(state) == set(part.required + part.optional), (part.name, sorted(state))
        assert not set(state) & set(merged), (part.name, sorted(set(state) & set(merged)))
        merged.update(state)
    return merged


# ------------------------------------------------------------------ run_state.json parts
@dataclass
class ResumeState:
    """The `position` part: what the loop needs besides tensors to continue exactly."""

    step: int = 0
    consumed_samples: int = 0
    gamma: Optional[float] = None
    skipped_iters: int = 0
    """Updates skipped so far because the loss or gradient norm was NaN/inf."""

    name, store = "position", RUN_STATE
    required = ("step", "consumed_samples")
    optional = ("gamma", "skipped_iters")
    fix = ("resume from a checkpoint the trainer saved, or load its weights only with "
           "--finetune")

    def state_dict(self) -> Dict:
        return {"step": self.step, "consumed_samples": self.consumed_samples,
                "gamma": self.gamma, "skipped_iters": self.skipped_iters}

    def load_state_dict(self, state: Dict) -> None:
        self.step, self.consumed_samples = state["step"], state["consumed_samples"]
        self.gamma, self.skipped_iters = state.get("gamma"), state.get("skipped_iters", 0)


class SchedulerPart:
    """The LR/WD scheduler; its load applies the schedule rule (schedule_rule.py) and keeps
    the rule's message in `note` for the log."""

    name, store = "scheduler", RUN_STATE
    required = ("scheduler",)
    optional = ()
    fix = "--no-load-optim (the schedule restarts from its step 0 with this run's settings)"

    def __init__(self, scheduler, training, fresh_groups: bool = False) -> None:
        self.scheduler, self.training = scheduler, training
        self.fresh_groups = fresh_groups
        """The optimizer's param groups were not restored (they hold this run's values)."""
        self.note: Optional[str] = None

    def state_dict(self) -> Dict:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: Dict) -> None:
        self.note = restore_scheduler(self.scheduler, state["scheduler"], self.training,
                                      self.fresh_groups)


@dataclass
class RunMetadata:
    """The `run metadata` part: what the checkpoint was saved from. Loading keeps it for
    the loader's decisions (the fingerprint is checked by checkpointing/ before any part)."""

    world_size: Optional[int] = None
    """Ranks at save time: the rng part applies only at the same world size."""
    layout: Optional[Dict[str, Optional[int]]] = None
    """tp, pp, ep, etp, vpp at save time (None in checkpoints older than the field)."""
    optimizer_format: Optional[str] = None
    fingerprint: Dict = field(default_factory=dict)
    config: Dict = field(default_factory=dict)
    ckpt_format: str = "torch_dist"
    """How the tensors are written (training.ckpt_format; checkpoints older than the field
    are torch_dist)."""

    name, store = "run metadata", RUN_STATE
    required = ("format", "fingerprint")
    optional = ("world_size", "layout", "optimizer_format", "config", "ckpt_format")
    fix = "the directory was not written by this trainer's save; point --load at one that was"

    def state_dict(self) -> Dict:
        return {"format": FORMAT, "world_size": self.world_size, "layout": self.layout,
                "optimizer_format": self.optimizer_format, "fingerprint": self.fingerprint,
                "config": self.config, "ckpt_format": self.ckpt_format}

    def load_state_dict(self, state: Dict) -> None:
        self.world_size = state.get("world_size")
        self.layout = state.get("layout")
        self.optimizer_format = state.get("optimizer_format")
        self.fingerprint, self.config = state["fingerprint"], state.get("config") or {}
        self.ckpt_format = state.get("ckpt_format") or "torch_dist"


# --------------------------------------------------------------------------- per rank
TRACKER_KEY = "rng_tracker_states"
"""Megatron's RNG-tracker states in the rng part (Megatron-LM's name for them)."""


class RngPart:
    """This rank's torch, Python and NumPy generators, the CUDA generator on a GPU, and
    Megatron's RNG-tracker states (model-parallel, expert-parallel, data-parallel; the
    streams of attention dropout and, with sequence parallelism, hidden dropout), as
    Megatron-LM's checkpoints keep them (rng/rank_<r>.pt: one file per rank, so per TP/PP/EP
    rank). Files written before the tracker states were kept load without them;
    `tracker_restored` then says False."""

    name, store = "rng", RANK_FILE

    def __init__(self) -> None:
        self.tracker_restored = False

    def state_dict(self) -> Dict:
        np_state = np.random.get_state()
        state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
                 "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
                 "numpy_pos": int(np_state[2]), TRACKER_KEY: _tracker_states()}
        cuda = device_rng_state()
        if cuda is not None:
            state["cuda"] = cuda
        return state

    def load_state_dict(self, state: Dict) -> None:
        torch.set_rng_state(state["torch"])
        random.setstate((3, tuple(state["python"]), None))
        np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32),
                             state["numpy_pos"], 0, 0.0))
        if "cuda" in state:
            set_device_rng_state(state["cuda"])
        self.tracker_restored = _tracker_fits(state.get(TRACKER_KEY))
        if self.tracker_restored:
            tensor_parallel.get_cuda_rng_tracker().set_states(dict(state[TRACKER_KEY]))


def _tracker_fits(saved: Optional[Dict[str, torch.Tensor]]) -> bool:
    """The saved tracker states exist and have this tracker's names and generator sizes (a
    CUDA generator state is 16 bytes, a CPU one 5056: a GPU checkpoint's states cannot drive
    the CPU tracker)."""
    if saved is None:
        return False
    current = tensor_parallel.get_cuda_rng_tracker().get_states()
    return (not current or set(saved) == set(current)) and all(
        saved[name].numel() == current[name].numel() for name in saved if name in current)


def _tracker_states() -> Dict[str, torch.Tensor]:
    """Copies of the tracker's named generator states (saved between steps, outside any
    fork, so they are current)."""
    return {name: state.clone() for name, state
            in tensor_parallel.get_cuda_rng_tracker().get_states().items()}


# ------------------------------------------------------------------------ tensor parts
class ModelPart:
    """The weights of this rank's model chunks (`model<i>` sharded entries)."""

    name, store = "model", TENSORS

    def __init__(self, chunks) -> None:
        self.chunks = chunks

    def state_dict(self) -> Dict:
        return model_sharded_state_dict(self.chunks)

    def load_state_dict(self, state: Dict) -> None:
        """`state`: what dist-checkpointing filled (its `model<i>` entries are this part's)."""
        set_model_weights(self.chunks, state)


class OptimizerPart:
    """Megatron's (distributed) optimizer state in the format `optimizer_format` (the
    `optimizer` entry); its sharded state dict is built over the model part's."""

    name, store = "optimizer", TENSORS

    def __init__(self, optimizer, optimizer_format: str, override_scheduler: bool,
                 model: ModelPart) -> None:
        self.optimizer, self.format, self.model = optimizer, optimizer_format, model
        self.override_scheduler = override_scheduler

    def state_dict(self) -> Dict:
        return self.sharded_state_dict(self.model.state_dict(), is_loading=False)

    def sharded_state_dict(self, model_state: Dict, is_loading: bool) -> Dict:
        """{"optimizer": Megatron's sharded optimizer state over `model_state`}."""
        metadata = {"distrib_optim_sharding_type": self.format}
        if not is_cuda():
            # fully_reshardable gathers over NCCL with `.cuda()` unless asked to use the
            # gloo data-parallel group (Megatron's memory-efficient variant): the CPU route.
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
        return {"optimizer": self.optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=metadata)}

    def load_state_dict(self, state: Dict) -> None:
        """Megatron's optimizer load of `state["optimizer"]`, with the saved param groups
        paired by structure so a changed --lr / --min-lr resumes (resume_groups.py), then the
        schedule rule's values."""
        state = state["optimizer"]
        checkpoint_values = align_saved_groups(self.optimizer, state)
        with torch.no_grad():  # fp32 main params are views of the model's leaf parameters
            self.optimizer.load_state_dict(state)
        apply_schedule_rule(self.optimizer, checkpoint_values, self.override_scheduler)


def tensor_state(parts: Dict[str, Stateful], is_loading: bool) -> Dict:
    """The one sharded state dict dist-checkpointing saves or fills: the model's entries,
    plus the optimizer's when `parts` has that part (built over the same model entries)."""
    state = parts["model"].state_dict()
    if "optimizer" in parts:
        state.update(parts["optimizer"].sharded_state_dict(state, is_loading))
    return state


# --------------------------------------------------------------------- loading rules
EXCLUDE_FROM_LOADING: Dict[str, FrozenSet[str]] = {
    "resume": frozenset(),
    # Megatron-LM's --no-load-optim: the iteration and data position still load; the
    # scheduler goes with the optimizer (Megatron-LM loads it only with the optimizer), and
    # the generators are reseeded as on a fresh start.
    "--no-load-optim": frozenset({"optimizer", "scheduler", "rng"}),
    # Megatron-LM's --finetune: the weights only; everything else starts fresh at step 0.
    "--finetune": frozenset({"optimizer", "scheduler", "rng", "position"}),
}
"""The parts each way of loading leaves at this run's values. Whatever the way, `run
metadata` is read first (the loader's decisions come from it) and `model` always loads."""

WEIGHTS_ONLY_ABSENT = frozenset({"optimizer", "scheduler"})
"""Parts a weights-only checkpoint may lack (saved before a first step: the trainer's step-0
save, an HF import, which carries the scheduler only when its export recorded one): absent,
they keep this run's values (the optimizer: its run_state says optimizer_format None; the
scheduler, only when the optimizer state was not restored either: a line says so). Any
other absent part is a CheckpointError naming it (`read_part`)."""


def loading_way(load_optimizer: bool, finetune: bool) -> str:
    """The key of EXCLUDE_FROM_LOADING for the load flags."""
    if finetune:
        return "--finetune"
    return "resume" if load_optimizer else "--no-load-optim"
