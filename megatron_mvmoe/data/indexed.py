"""Megatron indexed datasets (.bin/.idx): writing them, and checking them before training.

Design choices:
- Writing goes through Megatron-Core's own `IndexedDatasetBuilder`, one document per
  corpus document with the EOD id appended, so GPTDataset reads our files unchanged.
- Megatron's reader asserts on a bad header and otherwise trusts the file sizes: a
  truncated .bin shows up only as a numpy error, or as garbage, deep inside training.
  `check_indexed` re-reads the .idx layout (header, 4-byte lengths, 8-byte pointers,
  8-byte document indices) and compares every size against the index before a run starts.
- `dataset_meta.json` beside the files records the tokenizer's metadata and, per
  prefix, document/token counts and file sizes; `check_vocab` refuses a model or
  tokenizer that does not match it.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import Iterable, List, Optional

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron_mvmoe.data.errors import data_error

META_FILE = "dataset_meta.json"
META_FORMAT = "megatron_mvmoe.dataset/1"
_MAGIC = b"MMIDIDX\x00\x00"
_HEADER_BYTES = len(_MAGIC) + 8 + 1 + 8 + 8  # magic, version, dtype code, 2 counts
_FIX_REBUILD = "rerun tools/preprocess_data.py for this corpus"


@dataclass(frozen=True)
class IndexedStats:
    """What `check_indexed` found in one .bin/.idx pair."""

    prefix: str
    sequences: int
    documents: int
    tokens: int
    dtype: str
    bin_bytes: int
    idx_bytes: int
    max_token_id: int


def write_indexed(prefix: str, docs_ids: Iterable[List[int]], eod_id: int,
                  vocab_size: int) -> int:
    """Write documents (lists of ids) as prefix.bin/.idx, EOD appended; return #docs."""
    dtype = DType.optimal_dtype(vocab_size)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    count = 0
    for ids in docs_ids:
        builder.add_document(ids + [eod_id], [len(ids) + 1])
        count += 1
    builder.finalize(prefix + ".idx")
    return count


def _read_header(idx_path: str, idx_bytes: int):
    if idx_bytes < _HEADER_BYTES:
        raise data_error(idx_path, f"truncated .idx ({idx_bytes} bytes, header alone is "
                         f"{_HEADER_BYTES})", _FIX_REBUILD)
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if head[:9] != _MAGIC:
        raise data_error(idx_path, "not a Megatron .idx file (bad magic)", _FIX_REBUILD)
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in {d.value for d in DType}:
        raise data_error(idx_path, f"corrupt .idx header (version {version}, dtype code "
                         f"{code})", _FIX_REBUILD)
    return DType.dtype_from_code(code), sequences, documents


def check_indexed(prefix: str, vocab_size: Optional[int] = None) -> IndexedStats:
    """Check prefix.bin/.idx are present, consistent, non-empty; ids < vocab_size if given."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise data_error(path, "indexed dataset file missing",
                             f"{_FIX_REBUILD} (or fix the data path prefix '{prefix}')")
    idx_bytes, bin_bytes = os.path.getsize(idx_path), os.path.getsize(bin_path)
    dtype, sequences, documents = _read_header(idx_path, idx_bytes)
    expected = _HEADER_BYTES + sequences * (4 + 8) + documents * 8
    if idx_bytes != expected:
        raise data_error(idx_path, f"truncated or corrupt .idx: {idx_bytes} bytes, its header "
                         f"({sequences} sequences, {documents} document marks) needs "
                         f"{expected}", _FIX_REBUILD)
    lengths, pointers, doc_index = _read_arrays(idx_path, sequences, documents)
    _check_index_arrays(idx_path, lengths, pointers, doc_index, np.dtype(dtype).itemsize)
    if sequences == 0:
        raise data_error(prefix, "empty dataset (no documents)",
                         "build the corpus with more text (tools/build_corpus.py) and "
                         "preprocess it again")
    tokens = int(lengths.astype(np.int64).sum())
    if bin_bytes != tokens * np.dtype(dtype).itemsize:
        raise data_error(bin_path, f"truncated or corrupt .bin: {bin_bytes} bytes, the index "
                         f"describes {tokens} tokens of {np.dtype(dtype).name} = "
                         f"{tokens * np.dtype(dtype).itemsize} bytes", _FIX_REBUILD)
    max_id = int(np.memmap(bin_path, dtype=dtype, mode="r").max())
    if vocab_size is not None and max_id >= vocab_size:
        raise data_error(bin_path, f"holds token id {max_id} >= vocab size {vocab_size}: it "
                         "was tokenized with a larger vocabulary than the model's",
                         "preprocess with the model's tokenizer, or set the model's vocab "
                         "size from the dataset's tokenizer")
    return IndexedStats(prefix, sequences, documents - 1, tokens, np.dtype(dtype).name,
                        bin_bytes, idx_bytes, max_id)


def _read_arrays(idx_path: str, sequences: int, documents: int):
    with open(idx_path, "rb") as f:
        f.seek(_HEADER_BYTES)
        lengths = np.fromfile(f, dtype=np.int32, count=sequences)
        pointers = np.fromfile(f, dtype=np.int64, count=sequences)
        doc_index = np.fromfile(f, dtype=np.int64, count=documents)
    return lengths, pointers, doc_index


def _check_index_arrays(idx_path, lengths, pointers, doc_index, itemsize) -> None:
    """Pointers must be the running byte offsets of the lengths; doc marks 0..S, rising."""
    starts = np.concatenate([[0], np.cumsum(lengths.astype(np.int64))[:-1] * itemsize])
    ok = (lengths >= 0).all() and np.array_equal(pointers, starts[:len(pointers)])
    ok = ok and len(doc_index) >= 1 and doc_index[0] == 0 and doc_index[-1] == len(lengths)
    ok = ok and bool((np.diff(doc_index) >= 0).all())
    if not ok:
        raise data_error(idx_path, "corrupt .idx: sequence pointers or document marks are "
                         "inconsistent with the sequence lengths", _FIX_REBUILD)


# ---------------------------------------------------------------------------- metadata


def write_meta(directory: str, tokenizer_meta: dict, prefixes: dict, corpus: dict) -> str:
    path = os.path.join(directory, META_FILE)
    with open(path, "w") as f:
        json.dump({"format": META_FORMAT, "tokenizer": tokenizer_meta, "corpus": corpus,
                   "prefixes": prefixes}, f, indent=2)
    return path


def read_meta(prefix_or_dir: str) -> dict:
    """The dataset_meta.json of a preprocessed directory (given it or one of its prefixes)."""
    is_dir = os.path.isdir(prefix_or_dir)
    directory = prefix_or_dir if is_dir else os.path.dirname(prefix_or_dir)
    path = os.path.join(directory, META_FILE)
    if not os.path.isfile(path):
        raise data_error(path, "dataset metadata missing (it records which tokenizer made "
                         "the .bin files)", _FIX_REBUILD)
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != META_FORMAT:
        raise data_error(path, f"unknown format {meta.get('format')!r}", _FIX_REBUILD)
    return meta


def check_vocab(meta: dict, model_vocab_size: int, tokenizer_meta: Optional[dict] = None,
                where: str = META_FILE) -> None:
    """Refuse a model vocab smaller than the dataset's, or a different tokenizer."""
    data_tok = meta["tokenizer"]
    if model_vocab_size < data_tok["vocab_size"]:
        raise data_error(where, f"dataset was tokenized with {data_tok['kind']} "
                         f"(vocab {data_tok['vocab_size']}) but the model's vocab size is "
                         f"{model_vocab_size}", "set the model vocab size to at least "
                         f"{data_tok['vocab_size']} (padded), or preprocess with the "
                         "model's tokenizer")
    if tokenizer_meta is None:
        return
    keys = ("kind", "vocab_size", "vocab_sha256", "merges_sha256", "eod_id")
    diff = [k for k in keys if tokenizer_meta.get(k) != data_tok.get(k)]
    if diff:
        raise data_error(where, f"tokenizer mismatch on {diff}: dataset "
                         f"{ {k: data_tok.get(k) for k in diff} }, run "
                         f"{ {k: tokenizer_meta.get(k) for k in diff} }",
                         "train with the tokenizer saved in the dataset directory "
                         "(tokenizer/), or preprocess again with the one you use")
