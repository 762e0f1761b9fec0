"""What keeps a checkpoint root trustworthy: manifests, retention, disk full.

Design choices:
- Every checkpoint directory gets `manifest.json` (each file's relative path, size and
  SHA-256 from hashlib), written last and atomically, just before the directory is renamed
  into place: a checkpoint with a manifest is complete by construction.
- Hashing and verifying are split over the ranks (file i goes to rank i % world), so each
  byte is read once per save/load whatever the world size; the verdict is gathered so every
  rank raises the same one-line error, naming the first bad file and the fix.
- A checkpoint without a manifest is checked against what Megatron's dist-checkpointing
  records itself (torch_dist: torch DCP's `.metadata`, each item's file, offset and
  length; no checksums, so a shard missing or truncated is caught, altered bytes are
  not); directory.py then loads it only with --ckpt-allow-unverified.
- Retention (`--keep-last N`) never deletes the directory `latest` names, whatever N is.
- Publishing a finished save and recovering an interrupted publish: publish.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "megatron_mvmoe.manifest/1"
DELETED_PREFIX = ".deleted_"  # a directory being deleted (prune)


class IntegrityError(RuntimeError):
    """A checkpoint file is missing, truncated or altered (message: one line with the fix)."""


def _sha256(path: str) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _files(directory: str) -> List[str]:
    found = []
    for base, _, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(base, name), directory)
            if rel != MANIFEST and not rel.endswith(".tmp"):
                found.append(rel)
    return sorted(found)


def _my_share(items: List[str]) -> List[str]:
    return items[dist.get_rank()::dist.get_world_size()]


def write_manifest(directory: str) -> None:
    """Collective: hash every file of `directory` (split over ranks); rank 0 writes it."""
    names = _files(directory) if dist.get_rank() == 0 else None
    box = [names]
    dist.broadcast_object_list(box, src=0)
    local = {n: {"size": os.path.getsize(os.path.join(directory, n)),
                 "sha256": _sha256(os.path.join(directory, n))} for n in _my_share(box[0])}
    gathered: List[Optional[Dict]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    if dist.get_rank() == 0:
        files = {k: v for part in gathered for k, v in part.items()}
        write_json_atomic(os.path.join(directory, MANIFEST),
                          {"format": MANIFEST_FORMAT, "algorithm": "sha256",
                           "files": dict(sorted(files.items()))})


def _check_file(directory: str, name: str, entry: Dict) -> Optional[str]:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        return f"{path} is missing"
    size = os.path.getsize(path)
    if size != entry["size"]:
        return f"{path} has {size} bytes, the manifest says {entry['size']} (truncated or grown)"
    if _sha256(path) != entry["sha256"]:
        return f"{path} does not match its SHA-256 in {MANIFEST} (bytes altered)"
    return None


def manifest_mismatches(directory: str, fix: str) -> Optional[List[Tuple[str, str]]]:
    """Collective: (file, problem) for every file that does not match the manifest (sizes
    and checksums, split over ranks), sorted; None when there is no manifest (an old
    checkpoint). An unreadable manifest raises IntegrityError."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as fh:
            files = json.load(fh)["files"]
    except (OSError, ValueError, KeyError) as err:
        raise IntegrityError(f"{path} is unreadable ({err}). Fix: {fix}") from None
    problems = [(n, p) for n in _my_share(sorted(files))
                if (p := _check_file(directory, n, files[n])) is not None]
    gathered: List[Optional[List[Tuple[str, str]]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    return sorted(tuple(p) for part in gathered for p in part)


def corrupt_message(found: List[Tuple[str, str]], fix: str) -> str:
    """The one line for the mismatches `manifest_mismatches` found."""
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return f"corrupt checkpoint: {found[0][1]}{more}. Fix: {fix}"


def verify_manifest(directory: str, fix: str) -> bool:
    """Collective: check sizes and checksums (split over ranks). False when there is no
    manifest (an old checkpoint); raises IntegrityError naming the first bad file."""
    found = manifest_mismatches(directory, fix)
    if found:
        raise IntegrityError(corrupt_message(found, fix))
    return found is not None


def _dcp_file_ends(directory: str) -> Optional[Dict[str, int]]:
    """File -> end of its last item, from torch DCP's `.metadata` (Megatron's torch_dist
    backend writes it); None for another sharded backend."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        with open(os.path.join(directory, "metadata.json")) as fh:
            backend = json.load(fh).get("sharded_backend")
    except (OSError, ValueError):
        backend = None
    if backend not in (None, "torch_dist"):
        return None
    metadata = FileSystemReader(directory).read_metadata()
    ends: Dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0),
                                       info.offset + info.length)
    return ends


def verify_shard_sizes(directory: str, fix: str) -> bool:
    """Megatron's own integrity data for a checkpoint without a manifest: every shard file
    that `.metadata` names exists and ends where its last item ends. True when checked
    (False: a backend without such a record); raises IntegrityError naming the first bad
    file. Sizes only: altered bytes pass."""
    try:
        ends = _dcp_file_ends(directory)
    except Exception as err:  # noqa: BLE001 - any unreadable .metadata is one message
        raise IntegrityError(f"{directory}/.metadata (Megatron's checkpoint metadata) is "
                             f"unreadable ({type(err).__name__}). Fix: {fix}") from None
    if ends is None:
        return False
    for name, end in sorted(ends.items()):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise IntegrityError(f"corrupt checkpoint: {path} is missing (named in "
                                 f".metadata). Fix: {fix}")
        if os.path.getsize(path) != end:
            raise IntegrityError(f"corrupt checkpoint: {path} has {os.path.getsize(path)} "
                                 f"bytes, .metadata says {end} (truncated or grown). Fix: {fix}")
    return True


def write_json_atomic(path: str, payload) -> None:
    """Write, fsync, then rename over `path`: readers see the old file or the whole new one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1) if not isinstance(payload, str) else fh.write(payload)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def prune(root: str, keep_last: int, latest: str) -> List[str]:
    """Delete all but the newest `keep_last` iter_* dirs (0 = keep all), never `latest`.
    Each is renamed to .deleted_iter_* first, so a kill mid-delete leaves no half-deleted
    iter_* (the next start-up deletes the rest: publish.recover)."""
    if keep_last <= 0:
        return []
    names = sorted(d for d in os.listdir(root) if d.startswith("iter_"))
    doomed = [n for n in names[:-keep_last] if n != latest]
    for name in doomed:
        trash = os.path.join(root, DELETED_PREFIX + name)
        os.rename(os.path.join(root, name), trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def is_disk_full(err: BaseException, root: str) -> bool:
    """ENOSPC anywhere in the exception chain, or (writers such as torch's zip writer wrap
    it as "unexpected pos ...") less than 1 MiB left on the file system of `root`."""
    seen = 0
    while err is not None and seen < 20:
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left" in str(err):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    try:
        return shutil.disk_usage(root).free < 2 ** 20
    except OSError:
        return False


def first_nonfinite_parameter(named_weights) -> Optional[Tuple[int, str]]:
    """Collective: (rank, name) of a non-finite weight on any rank (None: all finite).
    `named_weights`: this rank's (name, tensor) pairs, the ones a save writes."""
    local = next((name for name, p in named_weights
                  if not torch.isfinite(p.detach()).all()), None)
    gathered: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    return next(((r, n) for r, n in enumerate(gathered) if n is not None), None)


def _one_line(err: BaseException) -> str:
    """`Type: first line of the message`, at most 300 characters; the type alone when the
    message is empty (`OSError()`, `KeyError('')` print nothing)."""
    lines = str(err).splitlines()
    return (f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__)[:300]


def first_failure(err: Optional[BaseException], root: str) -> Optional[Tuple[bool, str]]:
    """Collective: (disk full?, message) of the first rank whose save failed, or None.
    Every rank gets the same answer, so all raise together."""
    mine = None if err is None else (is_disk_full(err, root), _one_line(err))
    gathered: List[Optional[Tuple[bool, str]]] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return next((g for g in gathered if g is not None), None)
