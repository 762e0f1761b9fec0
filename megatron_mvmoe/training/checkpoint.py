"""Checkpoints with Megatron dist-checkpointing: crash-safe, resumable, reshardable.

Layout of a checkpoint root:
    latest                  one line: the directory name of the last good checkpoint
    iter_0000100/           Megatron dist-checkpoint (model + optimizer shards) plus
        run_state.json      step, consumed samples, gamma, scheduler, model fingerprint, config
        rng/rank_<r>.pt     per-rank RNG states (tensors only; torch.load weights_only=True)

Design choices:
- A save writes into `.tmp_iter_N`, then renames it to `iter_N`, then replaces `latest`
  through a temp file + os.replace: a crash at any point leaves the previous `latest` and
  its directory intact.
- Tensors (model, optimizer) go through dist-checkpointing, so a checkpoint saved at one
  TP/PP/EP layout loads at another; the distributed optimizer uses the
  `dp_reshardable` format (the default errors on CPU, MCORE notes).
- Everything else is JSON we read ourselves. The model fingerprint (every ModelShape field
  that changes a parameter shape or meaning) is compared before any tensor is read, and a
  mismatch names the differing fields.
- The RNG files are per rank; on a different world size they do not apply and the run
  reseeds from (seed, step) instead, which the log says.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import random
import shutil
from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_mvmoe.platform import is_cuda
from megatron_mvmoe.training.build import Trainer
from megatron_mvmoe.training.schedule_rule import restore_scheduler

LATEST = "latest"
RUN_STATE = "run_state.json"
FORMAT = "megatron_mvmoe.checkpoint/1"
OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable")
_NOT_STRUCTURAL = ("gamma_ramp_steps", "seq_length")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or from an incompatible model."""


@dataclass
class ResumeState:
    """What the loop needs besides tensors to continue exactly."""

    step: int = 0
    consumed_samples: int = 0
    gamma: Optional[float] = None


def fingerprint(trainer: Trainer) -> Dict:
    shape = dataclasses.asdict(trainer.shape)
    fields = {k: v for k, v in shape.items() if k not in _NOT_STRUCTURAL}
    # Switches that add parameters (learned alpha) or change what weights mean (BitNet);
    # recorded only when on, so checkpoints written before these switches still match.
    model = trainer.run.model
    for name in ("learned_gate_scale", "bitnet"):
        if getattr(model, name, None):
            fields[name] = True
    return fields


def _ensure_optimizer_state(optimizer) -> None:
    """Without apex/TE, DistributedOptimizer.state_dict() asserts on a fresh optimizer (no
    'step' yet), which a load must build first; give it placeholder states as Megatron's
    own FSDP path does. They are overwritten by the load together with the weights."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner, DistributedOptimizer) and len(inner.optimizer.state) == 0:
            inner._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer) -> None:
    """Megatron 0.16.1's torch-AdamW path (no apex/TE) restores the per-parameter 'step'
    wrongly: from the load placeholders (1, not the saved step) and as ONE tensor shared by
    every parameter, which AdamW then increments once per parameter. The saved step is in
    each param group (Megatron writes it there); give every state its own copy of it."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        for group in getattr(torch_optimizer, "param_groups", []):
            if group.get("step") is None:
                continue
            for param in group["params"]:
                state = torch_optimizer.state.get(param)
                if state and torch.is_tensor(state.get("step")):
                    state["step"] = torch.tensor(float(group["step"]),
                                                 dtype=state["step"].dtype)


def _sharded_state_dict(trainer: Trainer, is_loading: bool, optimizer_format: Optional[str]
                        ) -> Dict:
    state = {f"model{i}": chunk.sharded_state_dict()
             for i, chunk in enumerate(trainer.unwrapped())}
    if optimizer_format is None:
        return state
    if is_loading:
        _ensure_optimizer_state(trainer.optimizer)
    metadata = {"distrib_optim_sharding_type": optimizer_format}
    if not is_cuda():
        # fully_reshardable gathers over NCCL with `.cuda()` unless asked to use the gloo
        # data-parallel group (Megatron's memory-efficient variant): the CPU route.
        metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
    state["optimizer"] = trainer.optimizer.sharded_state_dict(
        state, is_loading=is_loading, metadata=metadata)
    return state


# ------------------------------------------------------------------------------- save
def _rng_state() -> Dict:
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]),
            "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
            "numpy_pos": int(np_state[2])}


def _write_json_atomic(path: str, payload) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1) if not isinstance(payload, str) else fh.write(payload)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _in_process_write_results() -> None:
    """Megatron 0.16.1's file writer collects write results through a module-level queue
    that it creates as `Manager().Queue()`: a helper *process* that outlives a rank killed
    by its launcher (holding the job's stdout open forever). Our saves are synchronous, so
    the queue is only used inside this process: hand it a plain in-process queue first."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is None:
        filesystem_async._results_queue = queue.Queue()


def save_checkpoint(trainer: Trainer, root: str, state: ResumeState) -> str:
    """Collective: save to root/iter_<step>, then point `latest` at it. Returns the dir."""
    _in_process_write_results()
    name = f"iter_{state.step:07d}"
    final, tmp = os.path.join(root, name), os.path.join(root, f".tmp_{name}")
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, "rng"))
    dist.barrier()
    # Before the first step the optimizer holds no state (Megatron cannot serialise it):
    # such a checkpoint carries the weights only.
    optimizer_format = trainer.run.training.ckpt_optimizer_format if state.step > 0 else None
    dist_checkpointing.save(_sharded_state_dict(trainer, False, optimizer_format), tmp)
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank_{rank}.pt"))
    dist.barrier()
    if rank == 0:
        _write_json_atomic(os.path.join(tmp, RUN_STATE), {
            "format": FORMAT, "step": state.step, "consumed_samples": state.consumed_samples,
            "gamma": state.gamma, "world_size": dist.get_world_size(),
            "layout": _layout(trainer), "optimizer_format": optimizer_format,
            "scheduler": trainer.scheduler.state_dict(), "fingerprint": fingerprint(trainer),
            "config": trainer.run.to_dict()})
        if os.path.exists(final):  # re-saving a step: keep the old one until the swap
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_json_atomic(os.path.join(root, LATEST), name + "\n")
    dist.barrier()
    return final


# ------------------------------------------------------------------------------- load
def resolve_checkpoint(path: str) -> str:
    """A checkpoint directory from a root (via `latest`) or a checkpoint dir itself."""
    if os.path.isfile(os.path.join(path, RUN_STATE)):
        return path
    pointer = os.path.join(path, LATEST)
    if not os.path.isfile(pointer):
        raise CheckpointError(f"--load {path}: no checkpoint here (no '{LATEST}' file and no "
                              f"{RUN_STATE}). Fix: pass the --save directory of an earlier "
                              "run, or drop --load to start fresh")
    with open(pointer) as fh:
        name = fh.read().strip()
    directory = os.path.join(path, name)
    if not os.path.isfile(os.path.join(directory, RUN_STATE)):
        raise CheckpointError(f"--load {path}: '{LATEST}' points at {name!r}, which is missing "
                              f"or has no {RUN_STATE} (deleted or corrupt). Fix: point "
                              f"'{LATEST}' at an intact iter_* directory")
    return directory


def read_run_state(directory: str) -> Dict:
    try:
        with open(os.path.join(directory, RUN_STATE)) as fh:
            meta = json.load(fh)
    except (OSError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{directory}/{RUN_STATE} is unreadable ({err}): the checkpoint "
                              "is corrupt. Fix: load an earlier iter_* directory") from err
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{directory}: format {meta.get('format')!r}, expected "
                              f"{FORMAT!r}. Fix: load a checkpoint written by megatron_mvmoe")
    return meta


def check_fingerprint(saved: Dict, current: Dict, directory: str) -> None:
    keys = sorted(set(saved) | set(current))
    diffs = [f"{k}: checkpoint {saved.get(k)!r} vs this run {current.get(k)!r}"
             for k in keys if saved.get(k) != current.get(k)]
    if diffs:
        raise CheckpointError(f"{directory} is from an incompatible model; differing fields: "
                              + "; ".join(diffs) + ". Fix: use the checkpoint's model config "
                              "(its run_state.json 'config') or start without --load")


def _restore_rng(directory: str, run_world_size: int, saved_world_size: int) -> bool:
    path = os.path.join(directory, "rng", f"rank_{dist.get_rank()}.pt")
    if run_world_size != saved_world_size or not os.path.isfile(path):
        return False
    rng = torch.load(path, weights_only=True)
    torch.set_rng_state(rng["torch"])
    random.setstate((3, tuple(rng["python"]), None))
    np.random.set_state(("MT19937", rng["numpy_keys"].numpy().astype(np.uint32),
                         rng["numpy_pos"], 0, 0.0))
    return True


def load_checkpoint(trainer: Trainer, path: str, load_optimizer: bool = True) -> ResumeState:
    """Collective: restore model (+ optimizer, scheduler, RNG, position) from `path`."""
    directory = resolve_checkpoint(path)
    meta = read_run_state(directory)
    check_fingerprint(meta["fingerprint"], fingerprint(trainer), directory)
    optimizer_format = _loadable_optimizer_format(trainer, meta, load_optimizer)
    sharded = _sharded_state_dict(trainer, True, optimizer_format)
    try:
        with torch.no_grad():  # the distributed optimizer's fp32 params need it (notes)
            loaded = dist_checkpointing.load(sharded, directory)
    except Exception as err:
        raise CheckpointError(f"{directory}: reading the tensors failed ({type(err).__name__}: "
                              f"{err}). The checkpoint is corrupt or incomplete. Fix: load an "
                              "earlier iter_* directory") from err
    for i, chunk in enumerate(trainer.unwrapped()):
        chunk.load_state_dict(loaded[f"model{i}"], strict=True)
    if optimizer_format is None:
        # bf16 runs keep fp32 main copies in the optimizer, made from the initial weights:
        # refresh them, or the first step would write the initial weights back.
        with torch.no_grad():
            trainer.optimizer.reload_model_params()
    if not load_optimizer:
        return ResumeState()
    if optimizer_format is not None:
        with torch.no_grad():  # fp32 main params are views of the model's leaf parameters
            trainer.optimizer.load_state_dict(loaded["optimizer"])
        _restore_adam_steps(trainer.optimizer)
    rule = restore_scheduler(trainer.scheduler, meta["scheduler"], trainer.run.training)
    if rule is not None and dist.get_rank() == 0:
        print(rule, flush=True)
    _restore_rng(directory, dist.get_world_size(), meta["world_size"])
    return ResumeState(step=meta["step"], consumed_samples=meta["consumed_samples"],
                       gamma=meta.get("gamma"))


def close_writer_processes() -> None:
    """Shut down the results-queue manager process Megatron's async file writer starts on
    the first save (module-level in 0.16.1). Left running, it outlives a rank that exits
    without atexit handlers (killed by a launcher or test spawner) and holds its stdout."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = getattr(filesystem_async, "_results_queue", None)
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        manager.shutdown()
    filesystem_async._results_queue = None


def _layout(trainer: Trainer) -> Dict[str, Optional[int]]:
    p = trainer.run.parallel
    return {"tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.etp, "vpp": p.vpp}


def _loadable_optimizer_format(trainer: Trainer, meta: Dict, load_optimizer: bool
                               ) -> Optional[str]:
    """The saved optimizer format, or None when the optimizer state cannot (or should not)
    be restored: dp_reshardable states reshard over data-parallel ranks only."""
    if not load_optimizer:
        return None
    saved = meta.get("optimizer_format")
    if saved is None:  # saved before the first step: weights only
        return None
    if saved == "dp_reshardable" and meta.get("layout") != _layout(trainer):
        if dist.get_rank() == 0:
            print(f"warning: checkpoint optimizer states are dp_reshardable (saved at layout "
                  f"{meta.get('layout')}, now {_layout(trainer)}): restoring weights, step, "
                  "scheduler and data position; Adam moments restart from zero. Save with "
                  "ckpt_optimizer_format=fully_reshardable to carry them across layouts",
                  flush=True)
        return None
    saved_ep = (meta.get("layout") or {}).get("ep", 1) or 1
    if saved == "fully_reshardable" and (saved_ep > 1) != (trainer.run.parallel.ep > 1):
        # With EP > 1 Megatron keeps expert parameters in a second (chained) optimizer;
        # with EP = 1 they share the dense one, so the saved state has another structure.
        if dist.get_rank() == 0:
            print(f"warning: optimizer states saved with ep={saved_ep} cannot load at "
                  f"ep={trainer.run.parallel.ep} (expert parameters move between Megatron's "
                  "dense and expert optimizers when EP switches between 1 and > 1): "
                  "restoring weights, step, scheduler and data position; Adam moments "
                  "restart from zero", flush=True)
        return None
    return saved


def list_checkpoints(root: str) -> List[str]:
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if d.startswith("iter_"))
