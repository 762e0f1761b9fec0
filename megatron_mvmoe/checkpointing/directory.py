"""A checkpoint root on disk and how a reader finds and trusts one of its checkpoints.

Layout of a checkpoint root (written by training/checkpoint.py):
    latest                  one line: the directory name of the last good checkpoint
    iter_0000100/           Megatron dist-checkpoint (model + optimizer shards) plus
        run_state.json      step, consumed samples, gamma, scheduler, model fingerprint, config
        rng/rank_<r>.pt     per-rank RNG states (tensors only; torch.load weights_only=True)
        manifest.json       every file's size and SHA-256, written last (integrity.py)
    .tmp_iter_0000200/      a save being written, then renamed to iter_0000200 (publish.py)
    .old_iter_0000100/      while iter_0000100 is re-saved: its previous copy

Design choices:
- A checkpoint is named by its root (the `latest` pointer), by root + step (Megatron-LM's
  --ckpt-step), or by its own iter_* directory; all three resolve here.
- Every problem is a CheckpointError naming the file and a fix, and the fix for a corrupt
  checkpoint names the newest earlier one to load instead.
- A checkpoint without its manifest is refused unless --ckpt-allow-unverified is given
  (Megatron's `.metadata` gives shard sizes, not checksums: a flipped byte would load).
- A run_state.json edited by hand (every tensor file still matching the manifest) is named
  as such, with the fix (restore it, or --ckpt-allow-unverified loads it as edited), not as
  corruption whose fix is deleting the checkpoint.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from megatron_mvmoe.checkpointing import integrity
from megatron_mvmoe.checkpointing.errors import CheckpointError

LATEST = "latest"
RUN_STATE = "run_state.json"
TMP_PREFIX, OLD_PREFIX = ".tmp_", ".old_"
FORMAT = "megatron_mvmoe.checkpoint/1"


def list_checkpoints(root: str) -> List[str]:
    if not os.path.isdir(root):
        return []
    return sorted(d for d in os.listdir(root) if d.startswith("iter_"))


RESUME_FIX = "pass the --save directory of an earlier run, or drop --load to start fresh"


def resolve_checkpoint(path: str, step: Optional[int] = None,
                       missing_fix: str = RESUME_FIX, flag: str = "--load") -> str:
    """A checkpoint directory from a root (via `latest`, or iter_<step> when `step` is
    given, Megatron-LM's --ckpt-step) or a checkpoint dir itself. `missing_fix` is the fix
    named when there is no checkpoint at `path` (a tool cannot "start fresh"); `flag` is
    the option that gave `path`."""
    if step is not None:
        directory = os.path.join(path, f"iter_{step:07d}")
        if not os.path.isfile(os.path.join(directory, RUN_STATE)):
            raise CheckpointError(f"--ckpt-step {step}: {directory} is missing or incomplete. "
                                  f"Fix: use one of {list_checkpoints(path) or 'none here'}")
        return directory
    if os.path.isfile(os.path.join(path, RUN_STATE)):
        return path
    pointer = os.path.join(path, LATEST)
    if not os.path.isfile(pointer):
        raise CheckpointError(f"{flag} {path}: no checkpoint here (no '{LATEST}' file and no "
                              f"{RUN_STATE}). Fix: {missing_fix}")
    with open(pointer) as fh:
        name = fh.read().strip()
    directory = os.path.join(path, name)
    if not os.path.isfile(os.path.join(directory, RUN_STATE)):
        raise CheckpointError(f"{flag} {path}: '{LATEST}' points at {name!r}, which is missing "
                              f"or has no {RUN_STATE} (deleted or corrupt). Fix: "
                              + _interrupted_publish_fix(path, name))
    return directory


def _interrupted_publish_fix(root: str, name: str) -> str:
    """A publish killed midway leaves the step under a temporary name, which only a training
    launch with --save on this root puts back (publish.recover): say so."""
    if any(os.path.isdir(os.path.join(root, prefix + name))
           for prefix in (TMP_PREFIX, OLD_PREFIX)):
        return (f"saving {name} was interrupted while it was put in place; a training launch "
                f"with --save {root} recovers it")
    return f"point '{LATEST}' at an intact iter_* directory"


def earlier_fix(directory: str) -> str:
    """The fix for a corrupt `directory`: the newest earlier checkpoint of its root."""
    root, name = os.path.split(os.path.normpath(directory))
    others = [d for d in list_checkpoints(root) if d < name]
    if others:
        return (f"load an earlier checkpoint with --load {root} --ckpt-step "
                f"{int(others[-1][5:])} (or delete {directory})")
    return f"delete {directory} and start fresh (no earlier checkpoint in {root})"


ALLOW_UNVERIFIED_FLAG = "--ckpt-allow-unverified"


def verify_checkpoint(directory: str, allow_unverified: bool = False) -> None:
    """Collective: every file against the manifest (CheckpointError naming the first bad
    one; an edited run_state.json alone loads with `allow_unverified`). Without a manifest,
    the shard sizes against Megatron's `.metadata`, and then only with `allow_unverified`
    (--ckpt-allow-unverified): nothing records the bytes."""
    fix = earlier_fix(directory)
    try:
        found = integrity.manifest_mismatches(directory, fix)
        if found is not None:
            _judge_manifest(directory, found, fix, allow_unverified)
            return
        sizes = integrity.verify_shard_sizes(directory, fix)
    except integrity.IntegrityError as err:
        raise CheckpointError(str(err)) from None
    checked = ("its shard sizes match Megatron's .metadata, which records no checksums"
               if sizes else "its sharded backend records no sizes or checksums")
    if not allow_unverified:
        raise CheckpointError(f"{directory} has no {integrity.MANIFEST}, so its bytes cannot "
                              f"be verified ({checked}). Fix: pass {ALLOW_UNVERIFIED_FLAG} to "
                              "load it anyway, or load a checkpoint that has its manifest")
    if dist.get_rank() == 0:
        print(f"warning: {directory} has no {integrity.MANIFEST}: {checked}; loading it "
              f"unverified ({ALLOW_UNVERIFIED_FLAG})", flush=True)


def _judge_manifest(directory: str, found: List[Tuple[str, str]], fix: str,
                    allow_unverified: bool) -> None:
    """Nothing when every file matches. When only run_state.json differs (the JSON metadata
    we read ourselves, edited by hand) while every tensor file matches, say so and load it
    only with `allow_unverified`; any other mismatch is corruption."""
    if not found:
        return
    if {name for name, _ in found} != {RUN_STATE}:
        raise integrity.IntegrityError(integrity.corrupt_message(found, fix))
    edited = (f"{os.path.join(directory, RUN_STATE)} differs from {integrity.MANIFEST} while "
              "every tensor file matches it (the run metadata was edited)")
    if not allow_unverified:
        raise CheckpointError(f"{edited}. Fix: restore the original {RUN_STATE}, or pass "
                              f"{ALLOW_UNVERIFIED_FLAG} to load it as edited (the tensor files "
                              "are still verified)")
    if dist.get_rank() == 0:
        print(f"warning: {edited}; loading it as edited ({ALLOW_UNVERIFIED_FLAG})", flush=True)


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
