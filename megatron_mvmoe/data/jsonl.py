"""Any JSONL -> Megatron `.bin/.idx`, as Megatron-LM's tools/preprocess_data.py does it.

Design choices:
- Same flags and output names as Megatron-LM: `--input` (a .jsonl file, one JSON object per
  line), `--json-keys text ...`, `--output-prefix P` -> `P_<key>_document.bin/.idx`, one
  document per line per key, `--append-eod` adds the tokenizer's EOD id.
- Written through Megatron-Core's own IndexedDatasetBuilder, so Megatron reads the files
  unchanged (and our trainer reads them with `--data-path P_text_document`).
- `--workers N` tokenizes in N processes, each building the tokenizer once from its
  spec (tokenizers are not all picklable); lines are handed out in ordered chunks, so the
  output is the same for any worker count.
- A line that is not JSON, not an object, or lacks a key fails naming the line and key.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

from megatron_mvmoe.data.errors import DataError, data_error
from megatron_mvmoe.data.indexed import check_indexed

Progress = Callable[[str], None]
_CHUNK = 256


@dataclass(frozen=True)
class TokenizerSpec:
    """How to build the tokenizer in each worker (Megatron-LM's tokenizer flags)."""

    tokenizer_type: str
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None

    def build(self):
        from megatron_mvmoe.data.tokenizers import build_tokenizer

        return build_tokenizer(self.tokenizer_type, self.vocab_file, self.merge_file,
                               self.tokenizer_model, self.vocab_size)


_WORKER_TOKENIZER = None


def _init_worker(spec: TokenizerSpec) -> None:
    global _WORKER_TOKENIZER  # per-process cache of the worker's own tokenizer
    _WORKER_TOKENIZER = spec.build()


def _encode_chunk(task: Tuple[int, List[str], Tuple[str, ...], bool]):
    first_line, lines, keys, append_eod = task
    tok = _WORKER_TOKENIZER
    out: Dict[str, List[List[int]]] = {k: [] for k in keys}
    texts: Dict[str, List[str]] = {k: [] for k in keys}
    for offset, line in enumerate(lines):
        record = _parse(line, first_line + offset, keys)
        for key in keys:
            texts[key].append(record[key])
    for key in keys:
        for ids in tok.tokenize_batch(texts[key]):
            out[key].append(list(ids) + ([tok.eod] if append_eod else []))
    return len(lines), sum(len(line) for line in lines), out


def _parse(line: str, number: int, keys: Sequence[str]) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise data_error(f"line {number}", f"not JSON ({err.msg})",
                         "one JSON object per line (JSONL)") from None
    if not isinstance(record, dict):
        raise data_error(f"line {number}", "not a JSON object", "one object per line")
    for key in keys:
        if not isinstance(record.get(key), str):
            raise data_error(f"line {number}", f"has no string field {key!r}",
                             f"--json-keys names fields every line has (it has "
                             f"{sorted(record)})")
        _check_unicode(record[key], key, number)
    return record


def _check_unicode(text: str, key: str, number: int) -> None:
    """JSON may escape a lone surrogate ("\\ud800"), which no tokenizer can encode (a
    TypeError deep in `tokenizers` otherwise)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise data_error(f"line {number}", f"field {key!r} holds a lone surrogate "
                         f"{text[err.start]!r} at character {err.start} (not valid Unicode)",
                         "remove or replace it in the source text (e.g. decode the original "
                         "bytes with errors='replace')") from None


def _chunks(path: str, keys, append_eod) -> Iterator[Tuple[int, List[str], tuple, bool]]:
    with open(path, encoding="utf-8") as fh:
        batch, first = [], 1
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            if not batch:
                first = number
            batch.append(line)
            if len(batch) == _CHUNK:
                yield first, batch, tuple(keys), append_eod
                batch = []
        if batch:
            yield first, batch, tuple(keys), append_eod


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def preprocess_jsonl(input_path: str, json_keys: Sequence[str], output_prefix: str,
                     spec: TokenizerSpec, append_eod: bool = True, workers: int = 1,
                     log_interval: int = 10000, progress: Optional[Progress] = None) -> dict:
    """Tokenize every line's `json_keys` into one indexed dataset per key; returns stats."""
    progress = progress or (lambda msg: None)
    if not os.path.isfile(input_path):
        raise data_error(input_path, "input file not found", "pass --input FILE.jsonl")
    if workers < 1:
        raise ValueError(f"--workers {workers}: must be >= 1. Fix: e.g. --workers 2")
    tokenizer = spec.build()
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    builders = {k: IndexedDatasetBuilder(output_prefix_for(output_prefix, k) + ".bin",
                                         dtype=dtype) for k in json_keys}
    start, docs, chars, next_report = time.time(), 0, 0, log_interval
    tasks = _chunks(input_path, json_keys, append_eod)
    with _pool(workers, spec) as pool, _naming_file(input_path):
        for count, size, encoded in pool(tasks):
            for key, documents in encoded.items():
                for ids in documents:
                    builders[key].add_document(np.asarray(ids, dtype=np.int64), [len(ids)])
            docs, chars = docs + count, chars + size
            if docs >= next_report:
                rate = chars / 1e6 / max(time.time() - start, 1e-9)
                progress(f"processed {docs} documents ({rate:.2f} MB/s)")
                next_report += log_interval
    if docs == 0:
        raise data_error(input_path, "no documents (empty file)", "give a non-empty JSONL")
    stats = {}
    for key, builder in builders.items():
        prefix = output_prefix_for(output_prefix, key)
        builder.finalize(prefix + ".idx")
        found = check_indexed(prefix, tokenizer.vocab_size)
        stats[key] = {"prefix": prefix, "documents": found.sequences, "tokens": found.tokens}
    progress(f"done: {docs} documents in {time.time() - start:.1f} s")
    return {"documents": docs, "outputs": stats, "tokenizer": tokenizer.metadata()}


@contextlib.contextmanager
def _naming_file(path: str):
    """A bad line's DataError (raised in a worker, which knows only the line) names the file."""
    try:
        yield
    except DataError as err:
        raise DataError(f"{path}: {err}") from None


class _pool:
    """`imap` over a process pool (order kept), or in-process for one worker."""

    def __init__(self, workers: int, spec: TokenizerSpec) -> None:
        self.workers, self.spec, self.pool = workers, spec, None

    def __enter__(self):
        if self.workers == 1:
            _init_worker(self.spec)
            return lambda tasks: map(_encode_chunk, tasks)
        self.pool = mp.get_context("fork").Pool(self.workers, _init_worker, (self.spec,))
        return lambda tasks: self.pool.imap(_encode_chunk, tasks)

    def __exit__(self, *exc) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()
