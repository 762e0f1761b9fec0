"""Checkpoints with Megatron dist-checkpointing: crash-safe, resumable, reshardable.

The layout of a checkpoint root and everything a reader needs (resolving, manifests, the
model fingerprint, the model weights) live in `megatron_mvmoe/checkpointing/`; this module
adds what only the trainer has: saving, and restoring the optimizer, scheduler, RNG and
data position. What a checkpoint holds is a set of named parts, each with
state_dict()/load_state_dict() (checkpoint_parts.py: model, optimizer, scheduler, rng,
position, run metadata); save and load iterate them (`checkpoint_parts`), a load leaving
out what its way of loading excludes (checkpoint_parts.EXCLUDE_FROM_LOADING).

Design choices:
- A save writes into `.tmp_iter_N`, then renames it to `iter_N` (a re-saved step's old copy
  is first renamed aside, deleted only after `latest` names the new one), then replaces
  `latest` through a temp file + os.replace: a crash at any point leaves a complete copy
  of every step `latest` may name, and the next start-up finishes or undoes the publish
  (checkpointing/publish.py).
- A save refuses non-finite weights; a failed write (disk full) on any rank raises the
  same error on every rank, removes the temp dir and keeps the previous checkpoint.
- Tensors (model, optimizer) go through dist-checkpointing, so a checkpoint saved at one
  TP/PP/EP layout loads at another; the distributed optimizer uses the
  `dp_reshardable` format (the default errors on CPU, MCORE notes).
- Everything else is JSON we read ourselves. The model fingerprint
  (checkpointing/fingerprint.py) is compared before any tensor is read, and a mismatch
  names the differing fields.
- The RNG files are per rank (torch, Python, NumPy, CUDA and Megatron's RNG-tracker
  states, as Megatron-LM keeps them); on a different world size or layout they do not
  apply and the run reseeds every generator and the tracker from (seed, step) instead,
  which the log says.
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from torch.distributed.checkpoint.api import CheckpointException

from megatron_mvmoe.checkpointing import integrity
from megatron_mvmoe.checkpointing.directory import LATEST, RUN_STATE
from megatron_mvmoe.checkpointing.errors import CheckpointError
from megatron_mvmoe.checkpointing.fingerprint import changed_on_resume, model_fingerprint
from megatron_mvmoe.checkpointing.integrity import write_json_atomic
from megatron_mvmoe.checkpointing.publish import publish
from megatron_mvmoe.checkpointing.weights import open_checkpoint, read_tensors
from megatron_mvmoe import platform
from megatron_mvmoe.config.model_section import model_section_from_dict
from megatron_mvmoe.platform import dist_ckpt_writer_queue as writer_queue
from megatron_mvmoe.training.adam_impl import apply_adam_impl
from megatron_mvmoe.training.build import Trainer
from megatron_mvmoe.training.checkpoint_parts import (EXCLUDE_FROM_LOADING, RANK_FILE,
                                                      TENSORS, WEIGHTS_ONLY_ABSENT, ModelPart,
                                                      OptimizerPart, ResumeState, RngPart,
                                                      RunMetadata, SchedulerPart, Stateful,
                                                      loading_way, read_part, run_state_of,
                                                      tensor_state)
from megatron_mvmoe.training.fsdp_checkpoint import (FsdpModelPart, FsdpOptimizerPart,
                                                      check_fsdp_layout, fsdp_weight_shards,
                                                      load_fsdp_tensors, save_fsdp_tensors)
from megatron_mvmoe.training.schedule_rule import describe_schedule

OPTIMIZER_FORMATS = ("dp_reshardable", "fully_reshardable")


def fingerprint(trainer: Trainer) -> Dict:
    """The fingerprint of the trainer's model (checkpointing/fingerprint.py)."""
    return model_fingerprint(trainer.run.model)


def checkpoint_parts(trainer: Trainer, position: ResumeState, optimizer_format: Optional[str]
                     ) -> Dict[str, Stateful]:
    """This trainer's checkpoint as named parts, in load order: run metadata (read first,
    the loader decides from it), position, model, then optimizer (its state is laid over
    the model's), scheduler (applied to the optimizer's groups), rng. No optimizer part
    when `optimizer_format` is None (none saved before a first step, or none loadable); no
    scheduler part for a trainer without one (an HF import whose export recorded none)."""
    fsdp = _is_fsdp_dtensor(trainer)
    model = (FsdpModelPart(trainer.model, trainer.run.model.num_experts) if fsdp
             else ModelPart(trainer.unwrapped()))
    parts: Dict[str, Stateful] = {
        "run metadata": RunMetadata(
            world_size=dist.get_world_size(), layout=_layout(trainer),
            optimizer_format=optimizer_format, fingerprint=fingerprint(trainer),
            config=trainer.run.to_dict(), ckpt_format=trainer.run.training.ckpt_format),
        "position": position, "model": model}
    override = bool(trainer.run.training.override_opt_param_scheduler)
    if optimizer_format is not None:
        parts["optimizer"] = (FsdpOptimizerPart(trainer.optimizer, override) if fsdp else
                              OptimizerPart(trainer.optimizer, optimizer_format, override,
                                            model))
    if trainer.scheduler is not None:
        parts["scheduler"] = SchedulerPart(trainer.scheduler, trainer.run.training,
                                           fresh_groups="optimizer" not in parts)
    parts["rng"] = RngPart()
    return parts


def _is_fsdp_dtensor(trainer: Trainer) -> bool:
    return trainer.run.training.ckpt_format == "fsdp_dtensor"


def _optimizer_format(trainer: Trainer) -> str:
    """What the optimizer part is saved as: fsdp_dtensor under Megatron-FSDP, else the
    distributed optimizer's configured format."""
    return ("fsdp_dtensor" if _is_fsdp_dtensor(trainer)
            else trainer.run.training.ckpt_optimizer_format)


def _stored_in(parts: Dict[str, Stateful], store: str) -> Dict[str, Stateful]:
    return {name: part for name, part in parts.items() if part.store == store}


def _rng_path(directory: str) -> str:
    return os.path.join(directory, "rng", f"rank_{dist.get_rank()}.pt")


# ------------------------------------------------------------------------------- save
def _weights_to_save(trainer: Trainer):
    """This rank's (name, tensor) of the weights a save writes: the model's parameters, or
    under Megatron-FSDP the local shards of its saved DTensors (training/fsdp_checkpoint.py).
    Not the FSDP module's parameters: between steps they are views of the unsharded
    weight buffer, whose memory is reused until the next forward gathers it."""
    if _is_fsdp_dtensor(trainer):
        return fsdp_weight_shards(trainer.model)
    return ((name, p) for chunk in trainer.unwrapped() for name, p in chunk.named_parameters())


def _refuse_nonfinite(trainer: Trainer, step: int, root: str) -> None:
    bad = integrity.first_nonfinite_parameter(_weights_to_save(trainer))
    if bad is not None:
        raise CheckpointError(f"refusing to save step {step}: parameter {bad[1]} on rank "
                              f"{bad[0]} is NaN/inf; {_kept(root)}. Fix: lower --lr or use "
                              "--skip-nonfinite, and resume from that checkpoint")


def _kept(root: str) -> str:
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as fh:
            return f"the previous checkpoint {os.path.join(root, fh.read().strip())} is kept"
    return "no earlier checkpoint exists"


def _start_shards(trainer: Trainer, tmp: str, state: ResumeState, background: bool):
    """Write (or, with `background`, stage and start writing) the tensor parts and the rng
    part; returns (Megatron's AsyncRequest or None, the JSON parts' run_state as of now)."""
    # Before the first step the optimizer holds no state (Megatron cannot serialise it):
    # such a checkpoint carries the weights only.
    optimizer_format = _optimizer_format(trainer) if state.step > 0 else None
    # async_strategy "mcore": Megatron's own writer (the default, "nvrx", needs the
    # nvidia-resiliency-ext package).
    extra = {"async_sharded_save": True, "async_strategy": "mcore"} if background else {}
    parts = checkpoint_parts(trainer, state, optimizer_format)
    if _is_fsdp_dtensor(trainer):  # synchronous (config: no async_save with it)
        save_fsdp_tensors(_stored_in(parts, TENSORS), tmp)
        request = None
    else:
        request = dist_checkpointing.save(tensor_state(parts, is_loading=False), tmp, **extra)
    # Only after Megatron's save started: it takes a non-empty directory for an earlier,
    # incomplete checkpoint ("Overwriting old incomplete / corrupted checkpoint...").
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)
    torch.save(parts["rng"].state_dict(), _rng_path(tmp))
    return request, run_state_of(list(_stored_in(parts, RUN_STATE).values()))


def _finish_shards(tmp: str, run_state: Dict) -> None:
    """Collective, after every rank's tensors are on disk: run_state.json, then the manifest."""
    dist.barrier()
    if dist.get_rank() == 0:
        write_json_atomic(os.path.join(tmp, RUN_STATE), run_state)
    dist.barrier()
    integrity.write_manifest(tmp)


def _collective_write(root: str, tmp: str, write) -> None:
    """Run `write()` (filling `tmp`); on a failure on any rank, every rank raises one
    CheckpointError (disk full named as such) and `tmp` is removed."""
    error: Optional[BaseException] = None
    try:
        write()
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - re-raised below on
        error = err  # every rank, with the path (CheckpointException is a BaseException)
    failure = integrity.first_failure(error, root)
    if failure is None:
        return
    raise _save_failed(root, tmp, *failure) from error


def _save_failed(root: str, tmp: str, disk_full: bool, message: str) -> CheckpointError:
    """Remove the unfinished `tmp` (rank 0) and say what failed and what was kept."""
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    what = (f"no space left on device writing {tmp}" if disk_full
            else f"saving {tmp} failed ({message})")
    return CheckpointError(f"{what}; {_kept(root)}. Fix: "
                           + ("free space there, --save elsewhere, or --keep-last N"
                              if disk_full else "check the --save file system"))


def _publish(trainer: Trainer, root: str, name: str) -> None:
    """Collective: rank 0 puts the finished temp dir in place, points `latest` at it and
    prunes (checkpointing/publish.py: no step's only complete copy is ever deleted)."""
    if dist.get_rank() == 0:
        publish(root, name, trainer.run.training.keep_last)
    dist.barrier()


def _prepare(trainer: Trainer, root: str, state: ResumeState, background: bool = False) -> str:
    (writer_queue.cross_process_results if background else
     writer_queue.in_process_results)()
    _refuse_nonfinite(trainer, state.step, root)
    name = f"iter_{state.step:07d}"
    if dist.get_rank() == 0:
        tmp = os.path.join(root, f".tmp_{name}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)  # empty: Megatron's save checks that (see _start_shards)
    dist.barrier()
    return name


def save_checkpoint(trainer: Trainer, root: str, state: ResumeState) -> str:
    """Collective: save to root/iter_<step>, then point `latest` at it. Returns the dir.
    Refuses non-finite weights; keeps the newest `keep_last` checkpoints."""
    name = _prepare(trainer, root, state)
    tmp = os.path.join(root, f".tmp_{name}")

    def write():
        _, run_state = _start_shards(trainer, tmp, state, background=False)
        _finish_shards(tmp, run_state)
    _collective_write(root, tmp, write)
    _publish(trainer, root, name)
    return os.path.join(root, name)


class AsyncSaver:
    """Checkpoints written in the background through Megatron's dist-checkpointing async
    path (`async_sharded_save` + AsyncCallsQueue): the step pays for staging the state and
    forking the writer; run_state.json, the manifest, the rename and `latest` follow in the
    finalize step once every rank's writer is done. One save in flight at a time."""

    def __init__(self) -> None:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue = AsyncCallsQueue()
        self.pending: Optional[str] = None
        # Start the writer's results Manager (a spawned process, ~2 s) now, before step 1,
        # instead of inside the first save.
        writer_queue.cross_process_results()
        filesystem_async.get_write_results_queue()

    def save(self, trainer: Trainer, root: str, state: ResumeState) -> str:
        """Collective: finish the previous save, then start this one; returns its future dir."""
        self.wait()
        name = _prepare(trainer, root, state, background=True)
        tmp = os.path.join(root, f".tmp_{name}")
        box = {}

        def start():
            box["request"], box["run_state"] = _start_shards(trainer, tmp, state, True)
        _collective_write(root, tmp, start)
        request = box["request"]
        request.add_finalize_fn(lambda: _finish_shards(tmp, box["run_state"]))
        request.add_finalize_fn(lambda: _publish(trainer, root, name))
        self.queue.schedule_async_request(request)
        self.pending = os.path.join(root, name)
        return self.pending

    def poll(self) -> Optional[str]:
        """Collective (one all-reduce) while a save is in flight: finalize it if every rank
        is done. Returns the directory just published, if any."""
        if self.pending is None or not self._finalize(blocking=False):
            return None
        done, self.pending = self.pending, None
        return done

    def wait(self) -> Optional[str]:
        """Collective: block until the save in flight is published."""
        if self.pending is None:
            return None
        self._finalize(blocking=True)
        done, self.pending = self.pending, None
        return done

    def _finalize(self, blocking: bool) -> bool:
        """Megatron raises a background writer's failure on every rank at finalize: turn it
        into our one-line CheckpointError, with the temp dir removed."""
        try:
            return bool(self.queue.maybe_finalize_async_calls(blocking=blocking))
        except (Exception, CheckpointException) as err:  # noqa: BLE001 - same on all ranks
            root, name = os.path.split(self.pending)
            self.pending = None
            raise _save_failed(root, os.path.join(root, f".tmp_{name}"),
                               integrity.is_disk_full(err, root),
                               str(err).strip().splitlines()[0][:200]) from err

    def close(self) -> None:
        self.queue.close()


# ------------------------------------------------------------------------------- load
def _load_rng(trainer: Trainer, directory: str, saved: RunMetadata, step: int,
              part: Optional[RngPart] = None) -> None:
    """The rng part, when this rank has one saved at the same world size and layout (the
    file of global rank r then belongs to the same TP/PP/EP/DP ranks); else every generator
    and Megatron's RNG tracker are reseeded from (seed, step), so a resharded resume is
    deterministic and does not replay step 0's dropout masks. The log says which."""
    path = _rng_path(directory)
    layout = _layout(trainer)
    part, reason = part or RngPart(), None
    if dist.get_world_size() != saved.world_size or saved.layout not in (None, layout):
        reason = (f"saved at world size {saved.world_size}, layout {saved.layout}; now "
                  f"{dist.get_world_size()}, {layout}")  # layout None: before the field
    elif not os.path.isfile(path):
        reason = f"{path} is missing"
    if reason is None:
        part.load_state_dict(torch.load(path, weights_only=True))
    else:
        platform.seed_all(trainer.run.training.seed + step)
    note = _rng_note(reason, part.tracker_restored, step)
    if note is not None and dist.get_rank() == 0:
        print(note, flush=True)


def _rng_note(reason: Optional[str], tracker_restored: bool, step: int) -> Optional[str]:
    """The log line for a resume whose random streams do not continue exactly (`reason`:
    why the rng part did not apply); None when they do."""
    if reason is not None:
        return (f"rng: the checkpoint's generator states do not apply ({reason}): every "
                f"generator and Megatron's RNG tracker reseeded from (seed, step {step}); "
                "with dropout > 0 the losses differ from an uninterrupted run's")
    if not tracker_restored:
        return ("rng: this checkpoint has no Megatron RNG-tracker states (saved before they "
                "were kept, or on another device type): the attention-dropout (and "
                "sequence-parallel hidden-dropout) streams restart as at step 1; with "
                "dropout > 0 the losses differ from an uninterrupted run's")
    return None


def load_checkpoint(trainer: Trainer, path: str, load_optimizer: bool = True,
                    step: Optional[int] = None, allow_unverified: bool = False,
                    finetune: bool = False) -> ResumeState:
    """Collective: restore the checkpoint's parts from `path` (iter_<step> when given), after
    checking every file against its manifest, and return the position (step, data, gamma).
    Which parts load is one rule (checkpoint_parts.EXCLUDE_FROM_LOADING): a resume all;
    `load_optimizer=False`, Megatron-LM's --no-load-optim, leaves out optimizer, scheduler
    and rng (the schedule restarts from its step 0); `finetune`, Megatron-LM's --finetune,
    loads the weights only. An optimizer state that cannot apply here is left out too
    (`_loadable_optimizer_format`, which says why)."""
    directory, meta = open_checkpoint(path, fingerprint(trainer), step, allow_unverified)
    saved = RunMetadata()
    read_part(saved, meta, directory)
    _check_tensor_format(trainer, saved, directory)
    _report_changed_fields(trainer, saved, directory)
    way = loading_way(load_optimizer, finetune)
    excluded = EXCLUDE_FROM_LOADING[way]
    position = ResumeState()
    optimizer_format = (None if "optimizer" in excluded
                        else _loadable_optimizer_format(trainer, saved, True))
    parts = {name: part for name, part
             in checkpoint_parts(trainer, position, optimizer_format).items()
             if name not in excluded and name != saved.name}
    loaded = _read_tensor_parts(trainer, _stored_in(parts, TENSORS), directory)
    for part in parts.values():
        _load_part(trainer, part, loaded, meta, directory, saved, position.step)
    # torch's load_state_dict restored the saved param groups' foreach/fused: the run's wins
    apply_adam_impl(trainer.optimizer, trainer.run.optimizer.torch_adam_impl)
    if "optimizer" not in parts:
        # bf16 runs keep fp32 main copies in the optimizer, made from the initial weights:
        # refresh them, or the first step would write the initial weights back.
        with torch.no_grad():
            trainer.optimizer.reload_model_params()
    if way == "--no-load-optim" and dist.get_rank() == 0:
        print(f"--no-load-optim: weights, step {position.step} and data position from "
              f"{directory}; fresh optimizer state, LR/WD schedule from its step 0 with "
              "this run's settings (Megatron-LM's --no-load-optim)", flush=True)
    return position


def _check_tensor_format(trainer: Trainer, saved: RunMetadata, directory: str) -> None:
    """The checkpoint's tensors are in the format this run reads (the two are not
    interchangeable: Megatron-FSDP's DTensors vs dist-checkpointing's sharded tensors)."""
    want = trainer.run.training.ckpt_format
    if saved.ckpt_format != want:
        fix = ("--use-megatron-fsdp --ckpt-format fsdp_dtensor" if saved.ckpt_format ==
               "fsdp_dtensor" else "drop --use-megatron-fsdp and --ckpt-format fsdp_dtensor")
        raise CheckpointError(f"{directory} holds {saved.ckpt_format} tensors; this run reads "
                              f"{want} (Megatron-LM's --ckpt-format). Fix: resume with {fix}")
    if want == "fsdp_dtensor":
        check_fsdp_layout(saved.layout, _layout(trainer), directory)


def _read_tensor_parts(trainer: Trainer, parts: Dict[str, Stateful], directory: str) -> Dict:
    """Collective: the tensor parts' saved states, read in the run's format."""
    if _is_fsdp_dtensor(trainer):
        return load_fsdp_tensors(parts, directory)
    return read_tensors(tensor_state(parts, is_loading=True), directory)


def _load_part(trainer: Trainer, part: Stateful, loaded: Dict, meta: Dict, directory: str,
               saved: RunMetadata, step: int) -> None:
    """One part from where it lives: the tensors read, run_state.json, this rank's rng file."""
    if part.store == TENSORS:
        part.load_state_dict(loaded)
    elif part.store == RANK_FILE:
        _load_rng(trainer, directory, saved, step, part)
    elif part.name in WEIGHTS_ONLY_ABSENT and part.fresh_groups and part.required[0] not in meta:
        _note_absent_schedule(trainer, directory, step)
    else:
        read_part(part, meta, directory)
        if getattr(part, "note", None) is not None and dist.get_rank() == 0:
            print(part.note, flush=True)  # the schedule rule's line


def _note_absent_schedule(trainer: Trainer, directory: str, step: int) -> None:
    """A weights-only checkpoint without a schedule (an HF import whose export recorded
    none; with the optimizer state restored a schedule must be there, read_part's error):
    this run's schedule applies, and the line says so."""
    if dist.get_rank() == 0:
        print(f"resume: {directory} carries no LR/WD schedule (weights only); this run's "
              f"schedule applies from step {step}: {describe_schedule(trainer.scheduler)}",
              flush=True)


def _report_changed_fields(trainer: Trainer, saved: RunMetadata, directory: str) -> None:
    """One line naming each model field that differs from the checkpoint's config (the
    fingerprint passed, so none holds parameters: the dispatcher, the gamma ramp, ...)."""
    if dist.get_rank() != 0 or not saved.config.get("model"):
        return
    changes = changed_on_resume(model_section_from_dict(saved.config["model"]),
                                trainer.run.model)
    if changes:
        print(f"resume: model fields that hold no parameters differ from {directory}'s "
              f"config; this run's apply: {'; '.join(changes)}", flush=True)


def _layout(trainer: Trainer) -> Dict[str, Optional[int]]:
    p = trainer.run.parallel
    return {"tp": p.tp, "pp": p.pp, "ep": p.ep, "etp": p.etp, "vpp": p.vpp}


def _loadable_optimizer_format(trainer: Trainer, saved: RunMetadata, load_optimizer: bool
                               ) -> Optional[str]:
    """The saved optimizer format, or None when the optimizer state cannot (or should not)
    be restored: dp_reshardable states reshard over data-parallel ranks only."""
    if not load_optimizer or saved.optimizer_format is None:  # None: saved before step 1
        return None
    saved_ep = (saved.layout or {}).get("ep", 1) or 1
    if (saved_ep > 1) != (trainer.run.parallel.ep > 1):
        # Checked first, for both formats: with EP > 1 Megatron keeps expert parameters in a
        # second (chained) optimizer whose sharded keys carry a `chained_<i>.` prefix; with
        # EP = 1 one optimizer holds them all without it, so neither format's keys match.
        if dist.get_rank() == 0:
            print(f"warning: optimizer states saved with ep={saved_ep} cannot load at "
                  f"ep={trainer.run.parallel.ep} (expert parameters move between Megatron's "
                  "dense and expert optimizers when EP switches between 1 and > 1, in "
                  "either optimizer format): restoring weights, step, scheduler and data "
                  "position; Adam moments restart from zero", flush=True)
        return None
    if saved.optimizer_format == "dp_reshardable" and saved.layout != _layout(trainer):
        if dist.get_rank() == 0:
            print(f"warning: checkpoint optimizer states are dp_reshardable (saved at layout "
                  f"{saved.layout}, now {_layout(trainer)}): restoring weights, step, "
                  "scheduler and data position; Adam moments restart from zero. Save with "
                  "ckpt_optimizer_format=fully_reshardable to carry them across layouts",
                  flush=True)
        return None
    return saved.optimizer_format

