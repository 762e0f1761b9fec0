"""How a finished save becomes the checkpoint `latest` names, and how the next start-up
finishes (or undoes) a publish that a crash interrupted.

The publish sequence (rank 0, after every rank's files and the manifest are written):
  1. a re-save of step N (iter_N exists, often the one `latest` names): rename it to
     .old_iter_N -- kept, not deleted, until the new copy is in place
  2. rename .tmp_iter_N to iter_N
  3. point `latest` at iter_N (temp file + os.replace), then Megatron-LM's tracker
     `latest_checkpointed_iteration.txt` at N (the same way; its content is what
     Megatron-LM writes: the bare iteration number), so Megatron-LM's tooling finds it
  4. delete .old_iter_N; retention renames each pruned iter_M to .deleted_iter_M, then
     deletes it (integrity.prune)
Each step is one rename (or a delete of something no longer needed), so a kill between
any two leaves one of a few states, and in each a complete copy of every step `latest`
may name still exists under one of the names recover() looks at.

Recovery (collective, before resume, under the save-dir lock):
- .tmp_iter_N whose manifest verifies: a finished save whose publish was cut short; it is
  published (steps 1-4). Its manifest is written last, after every rank's shards, so it
  is complete by construction; the hash check guards against files damaged since.
- any other .tmp_iter_N: an unfinished save; deleted.
- .old_iter_N: with iter_N in place it is the superseded copy (only a complete temp dir
  is ever renamed to iter_N), deleted; with iter_N missing it is renamed back.
- .deleted_*: the remains of a delete that was cut short; deleted.
`latest` is only ever rewritten by a publish: a recovery never re-points it at an older
or newer checkpoint the user chose not to load. The tracker follows `latest`: recovery
rewrites it when it is missing or names another step (a kill between steps 3's two
writes, or a root saved before the tracker existed).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from typing import List

import torch.distributed as dist

from megatron_mvmoe.checkpointing import integrity
from megatron_mvmoe.checkpointing.directory import LATEST, OLD_PREFIX, TMP_PREFIX

TRACKER = "latest_checkpointed_iteration.txt"
"""Megatron-LM's tracker file (megatron/training/checkpointing.py,
get_checkpoint_tracker_filename): the iteration `latest` names, as a bare number."""


@dataclass
class Recovery:
    """What recover() did, for the start-up log."""
    published: List[str] = field(default_factory=list)  # finished saves put in place
    restored: List[str] = field(default_factory=list)   # old copies renamed back
    removed: List[str] = field(default_factory=list)    # unfinished saves deleted


def _paths(root: str, name: str):
    return tuple(os.path.join(root, prefix + name) for prefix in ("", TMP_PREFIX, OLD_PREFIX))


def publish(root: str, name: str, keep_last: int = 0) -> List[str]:
    """Rank 0: put the finished root/.tmp_<name> in place as root/<name>, point `latest`
    at it, prune to `keep_last`. Returns the pruned names."""
    final, tmp, old = _paths(root, name)
    if os.path.exists(final):
        # An .old left by a delete that failed earlier is superseded by `final`, which is
        # complete (only a complete temp dir is ever renamed to a final name).
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    integrity.write_json_atomic(os.path.join(root, LATEST), name + "\n")
    write_tracker(root, name)
    shutil.rmtree(old, ignore_errors=True)
    return integrity.prune(root, keep_last, name)


def write_tracker(root: str, name: str) -> None:
    """Megatron-LM's tracker at the iteration of `name` (iter_<N>), written atomically."""
    match = re.fullmatch(r"iter_(\d+)", name)
    if match:
        integrity.write_json_atomic(os.path.join(root, TRACKER), str(int(match.group(1))))


def _sync_tracker(root: str) -> None:
    """Rank 0: the tracker names what `latest` names (rewritten only when it does not)."""
    latest = os.path.join(root, LATEST)
    if not os.path.isfile(latest):
        return
    with open(latest) as fh:
        name = fh.read().strip()
    match = re.fullmatch(r"iter_(\d+)", name)
    tracker = os.path.join(root, TRACKER)
    current = open(tracker).read().strip() if os.path.isfile(tracker) else None
    if match and current != str(int(match.group(1))):
        write_tracker(root, name)


def _leftovers(root: str, prefix: str) -> List[str]:
    """The checkpoint names (iter_*) that have a `prefix` directory in root."""
    if not os.path.isdir(root):
        return []
    return sorted(d[len(prefix):] for d in os.listdir(root)
                  if d.startswith(prefix + "iter_"))


def _verified(directory: str) -> bool:
    """Collective: the directory has a manifest and every file matches it."""
    try:
        return integrity.verify_manifest(directory, fix="")
    except integrity.IntegrityError:
        return False


def recover(root: str) -> Recovery:
    """Collective (every rank, the same answer): finish or undo what interrupted saves
    and publishes left in `root` (see the module doc). Call before anything is loaded
    from or saved to `root`."""
    box = [_leftovers(root, TMP_PREFIX) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    finished = [n for n in box[0] if _verified(os.path.join(root, TMP_PREFIX + n))]
    result = [_recover_files(root, finished) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(result, src=0)
    return result[0]


def _recover_files(root: str, finished: List[str]) -> Recovery:
    """Rank 0: the file operations of recover(), given the temp dirs that verified."""
    done = Recovery()
    for name in _leftovers(root, TMP_PREFIX):
        if name in finished:
            publish(root, name)
            done.published.append(name)
        else:
            shutil.rmtree(os.path.join(root, TMP_PREFIX + name), ignore_errors=True)
            done.removed.append(TMP_PREFIX + name)
    for name in _leftovers(root, OLD_PREFIX):
        final, _, old = _paths(root, name)
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, final)
            done.restored.append(name)
    for name in _leftovers(root, integrity.DELETED_PREFIX):
        shutil.rmtree(os.path.join(root, integrity.DELETED_PREFIX + name), ignore_errors=True)
    _sync_tracker(root)
    return done
