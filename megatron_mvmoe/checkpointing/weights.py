"""A checkpoint's model weights into GPTModel chunks, through Megatron's dist-checkpointing.

Design choices:
- The sharded state dict of the model is `model<i>` -> chunk i's own
  `sharded_state_dict()`, the keys the trainer saves under (training/checkpoint.py builds
  its save and resume dicts with `model_sharded_state_dict` too), so a checkpoint written by
  the trainer loads bit-identically, and at any TP/PP/EP layout dist-checkpointing can
  reshard to.
- Before any tensor is read: the directory is resolved, every file is checked against the
  manifest and the model fingerprint is compared (`open_checkpoint`); each failure is one
  CheckpointError naming the problem and the fix.
- A Megatron-FSDP run's checkpoint (--ckpt-format fsdp_dtensor) is read by
  checkpointing/fsdp_weights.py into the same chunks, at any TP/ETP/EP layout.
- Only the weights: the optimizer state, scheduler, RNG and data position stay on disk (the
  trainer restores those on top, training/checkpoint.py).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
from megatron.core import dist_checkpointing

from megatron_mvmoe.checkpointing.directory import (earlier_fix, read_run_state,
                                                    resolve_checkpoint, verify_checkpoint)
from megatron_mvmoe.checkpointing.errors import CheckpointError
from megatron_mvmoe.checkpointing.fingerprint import check_fingerprint
from megatron_mvmoe.checkpointing.fsdp_weights import read_fsdp_weights


def open_checkpoint(path: str, fingerprint: Dict, step: Optional[int] = None,
                    allow_unverified: bool = False) -> Tuple[str, Dict]:
    """Collective: (checkpoint directory, its run_state) once the files are verified
    (without a manifest: only with `allow_unverified`) and the saved fingerprint equals
    `fingerprint` (the model about to receive the weights)."""
    directory = resolve_checkpoint(path, step)
    verify_checkpoint(directory, allow_unverified)
    meta = read_run_state(directory)
    check_fingerprint(meta["fingerprint"], fingerprint, directory)
    return directory, meta


def model_sharded_state_dict(chunks: List[torch.nn.Module]) -> Dict:
    """The model part of a checkpoint's sharded state dict (unwrapped GPTModel chunks)."""
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def read_tensors(sharded: Dict, directory: str) -> Dict:
    """Collective: dist-checkpointing's load of `sharded`; a failure is a CheckpointError."""
    try:
        with torch.no_grad():  # the distributed optimizer's fp32 params need it (notes)
            return dist_checkpointing.load(sharded, directory)
    except Exception as err:
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
        raise CheckpointError(f"{directory}: reading the tensors failed ({type(err).__name__}: "
                              f"{first}): the checkpoint is corrupt or incomplete. Fix: "
                              f"{earlier_fix(directory)}") from err


def set_model_weights(chunks: List[torch.nn.Module], loaded: Dict) -> None:
    """Copy the loaded `model<i>` entries into the chunks (strict: every key must match)."""
    for i, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded[f"model{i}"], strict=True)


def load_weights(chunks: List[torch.nn.Module], path: str, fingerprint: Dict,
                 step: Optional[int] = None, allow_unverified: bool = False) -> Dict:
    """Collective: load the model weights of the checkpoint at `path` (a root, or iter_<step>
    of it when `step` is given, or a checkpoint directory) into unwrapped GPTModel chunks
    built for the same model (`fingerprint`: `fingerprint.run_fingerprint(run)`). Returns
    the checkpoint's run_state (step, config, ...)."""
    directory, meta = open_checkpoint(path, fingerprint, step, allow_unverified)
    if meta.get("ckpt_format") == "fsdp_dtensor":  # a Megatron-FSDP run's
        read_fsdp_weights(chunks, directory, meta.get("layout"))
    else:
        set_model_weights(chunks, read_tensors(model_sharded_state_dict(chunks), directory))
    return meta
