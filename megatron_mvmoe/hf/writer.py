"""Writing a Hugging Face model directory atomically.

Layout written: config.json, generation_config.json, model-0000i-of-0000n.safetensors with
model.safetensors.index.json, tokenizer.json + tokenizer_config.json +
special_tokens_map.json, and for our own class its remote code (hf/remote/'s REMOTE_FILES and
the functional/ files they import as siblings).

Design choices:
- Everything is written into `<out>.partial-<pid>` beside the target and renamed onto it
  last, so a directory at `<out>` is always complete; a failure removes the partial one. An
  existing `<out>` is refused unless `overwrite` (then replaced only after the new one is
  whole).
- Shards fill in state-dict order up to `max_shard_bytes` (one tensor never splits); the
  index is written even for one shard, so readers find weights one way.
- Tensors are written contiguous and unshared (safetensors refuses shared storage).
- Every file gets the mode the process's umask gives a new file (0644 under umask 022):
  safetensors writes its files 0600, which others sharing the filesystem cannot read.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from megatron_mvmoe.errors import require

REMOTE_DIR = Path(__file__).resolve().parent / "remote"
FUNCTIONAL_DIR = Path(__file__).resolve().parents[1] / "functional"
REMOTE_FILES = ("configuration_mvmoe.py", "modeling_mvmoe.py", "basic_layers.py", "moe_layers.py",
                "mla_attention.py")
FUNCTIONAL_FILES = ("routing.py", "mixing.py", "quantize.py")
INDEX = "model.safetensors.index.json"


def shard_plan(state: Dict[str, torch.Tensor], max_shard_bytes: int) -> List[List[str]]:
    """Names per shard, in order; a shard closes before it would pass max_shard_bytes."""
    require(max_shard_bytes > 0, "--max-shard-size", f"must be > 0, got {max_shard_bytes}",
            "use e.g. 2GB")
    shards: List[List[str]] = [[]]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_shards(directory: str, state: Dict[str, torch.Tensor], max_shard_bytes: int) -> int:
    """model-*.safetensors + the index; returns the total tensor bytes."""
    from safetensors.torch import save_file

    plan = shard_plan(state, max_shard_bytes)
    weight_map, total = {}, 0
    for i, names in enumerate(plan, start=1):
        filename = f"model-{i:05d}-of-{len(plan):05d}.safetensors"
        tensors = {name: state[name].detach().contiguous().clone() for name in names}
        save_file(tensors, os.path.join(directory, filename), metadata={"format": "pt"})
        for name, tensor in tensors.items():
            weight_map[name] = filename
            total += tensor.numel() * tensor.element_size()
    write_json(os.path.join(directory, INDEX),
               {"metadata": {"total_size": total}, "weight_map": weight_map})
    return total


def write_json(path: str, value) -> None:
    with open(path, "w") as fh:
        json.dump(value, fh, indent=2, sort_keys=True)
        fh.write("\n")


def write_tokenizer(directory: str, tokenizer, eod_token: Optional[str]) -> bool:
    """tokenizer.json (+ config files for AutoTokenizer) from our tokenizer's `tokenizers`
    object; False when the tokenizer has none (NullTokenizer, sentencepiece)."""
    backend = getattr(tokenizer, "_tok", None) or getattr(tokenizer, "_bpe", None)
    if backend is None:
        return False
    backend.save(os.path.join(directory, "tokenizer.json"))
    special = {"eos_token": eod_token, "bos_token": eod_token, "unk_token": eod_token}
    write_json(os.path.join(directory, "tokenizer_config.json"),
               dict(special, tokenizer_class="PreTrainedTokenizerFast",
                    model_max_length=int(1e30), clean_up_tokenization_spaces=False,
                    split_special_tokens=_eod_text_is_text(tokenizer, eod_token)))
    write_json(os.path.join(directory, "special_tokens_map.json"), special)
    return True


def _eod_text_is_text(tokenizer, eod_token: Optional[str]) -> bool:
    """Whether the run's tokenizer reads a literal end-of-document token in text as text: a
    vocab.json + merges.txt tokenizer does (as Megatron-LM's GPT2BPETokenizer does), one from
    a tokenizer.json declaring it special gives the EOD id. transformers gives the EOD id
    unless told to split special tokens (tests/data/test_tokenizer_paths.py)."""
    return eod_token is not None and tokenizer.tokenize(eod_token) != [tokenizer.eod]


def copy_remote_code(directory: str) -> None:
    """Our class's code: the remote files and the functional/ math they import, flat (their
    relative imports are siblings, as transformers loads them from the directory)."""
    for name in REMOTE_FILES:
        shutil.copyfile(REMOTE_DIR / name, os.path.join(directory, name))
    for name in FUNCTIONAL_FILES:
        shutil.copyfile(FUNCTIONAL_DIR / name, os.path.join(directory, name))


def write_atomically(out: str, fill: Callable[[str], None], overwrite: bool = False) -> None:
    """Run `fill(partial_dir)`, then move the finished directory to `out`."""
    out = os.path.abspath(out)
    require(overwrite or not os.path.exists(out), "--out", f"{out} already exists",
            "choose a new directory or pass --overwrite")
    partial = f"{out}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    try:
        fill(partial)
        respect_umask(partial)
        if os.path.exists(out):
            old = f"{out}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(partial, out)
            shutil.rmtree(old)
        else:
            os.rename(partial, out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def respect_umask(directory: str) -> None:
    """chmod every file under `directory` to 0666 & ~umask (what open() would give)."""
    mode = 0o666 & ~current_umask()
    for path in Path(directory).rglob("*"):
        if path.is_file():
            os.chmod(path, mode)


def directory_bytes(directory: str) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())
