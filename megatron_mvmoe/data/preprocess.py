"""Tokenize a built corpus into one Megatron indexed dataset per domain and split.

Design choices:
- Output directory layout (self-contained, so a run needs only this directory):
    <out>/<domain>_<split>.bin/.idx   one per domain and split, EOD after every document
    <out>/tokenizer/vocab.json, merges.txt   the tokenizer that made them
    <out>/dataset_meta.json   tokenizer metadata, per-prefix counts and sizes, corpus sha256s
- The small BPE is trained on the train split only (held-out text must not shape the
  vocabulary), on an equal-size sample per domain taken with a fixed stride, so the
  46 MB reference domain does not dominate the merges.
- Every written pair is re-checked with `check_indexed` before the metadata is written.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

from megatron_mvmoe.data.corpus import SPLITS, iter_texts, load_manifest
from megatron_mvmoe.data.errors import data_error
from megatron_mvmoe.data.indexed import check_indexed, write_indexed, write_meta
from megatron_mvmoe.data.tokenize import Tokenizer, gpt2_tokenizer, train_bpe

Progress = Callable[[str], None]
TOKENIZER_DIR = "tokenizer"


@dataclass
class PreprocessConfig:
    """How to tokenize a corpus."""

    corpus_dir: str
    """A directory written by tools/build_corpus.py."""

    out_dir: str
    """Where the .bin/.idx files, tokenizer/ and dataset_meta.json go."""

    tokenizer: str = "bpe"
    """'gpt2' (the real 50257-token GPT-2 BPE) or 'bpe' (trained here, small, for CPU)."""

    vocab_size: int = 4096
    """Vocabulary size of the trained BPE (ignored for gpt2)."""

    bpe_train_mb: float = 4.0
    """Train-split text per domain used to train the BPE, in MB (sampled by stride)."""

    batch_docs: int = 512
    """Documents per tokenizer batch call."""

    def __post_init__(self) -> None:
        if self.tokenizer not in ("gpt2", "bpe"):
            raise ValueError(f"tokenizer={self.tokenizer!r}: unknown. Fix: 'gpt2' or 'bpe'")
        if self.bpe_train_mb <= 0:
            raise ValueError(f"bpe_train_mb={self.bpe_train_mb}: must be > 0. Fix: e.g. 4")


def prefix_name(domain: str, split: str) -> str:
    return f"{domain}_{split}"


def bpe_training_texts(corpus_dir: str, manifest: dict, mb_per_domain: float) -> Iterator[str]:
    """About `mb_per_domain` MB of train text per domain, every k-th document."""
    for domain in manifest["domains"]:
        total = manifest["files"][f"{domain}.train"]["text_bytes"]
        stride = max(1, math.ceil(total / (mb_per_domain * 1e6)))
        for i, text in enumerate(iter_texts(corpus_dir, domain, "train")):
            if i % stride == 0:
                yield text


def _make_tokenizer(config: PreprocessConfig, manifest: dict, progress: Progress) -> Tokenizer:
    tok_dir = os.path.join(config.out_dir, TOKENIZER_DIR)
    if config.tokenizer == "gpt2":
        tokenizer = gpt2_tokenizer()
        tokenizer.save(tok_dir)  # the dataset directory carries its own tokenizer
        return tokenizer
    start = time.time()
    texts = bpe_training_texts(config.corpus_dir, manifest, config.bpe_train_mb)
    tokenizer = train_bpe(texts, config.vocab_size, tok_dir)
    progress(f"trained byte-level BPE, vocab {tokenizer.vocab_size}, "
             f"{time.time() - start:.1f} s -> {tok_dir}")
    return tokenizer


def _token_lists(tokenizer: Tokenizer, texts: Iterator[str], batch: int,
                 report: Callable[[int], None]) -> Iterator[List[int]]:
    chunk: List[str] = []
    done = 0
    for text in texts:
        chunk.append(text)
        if len(chunk) == batch:
            yield from tokenizer.tokenize_batch(chunk)
            done += len(chunk)
            chunk = []
            if done % (batch * 50) == 0:
                report(done)
    if chunk:
        yield from tokenizer.tokenize_batch(chunk)


def _check_corpus_files(corpus_dir: str, manifest: dict) -> None:
    """Fail before any tokenizing if a domain/split file is missing or empty."""
    for domain in manifest["domains"]:
        for split in SPLITS:
            path = os.path.join(corpus_dir, f"{domain}.{split}.jsonl")
            if not os.path.isfile(path) or os.path.getsize(path) == 0:
                raise data_error(path, "empty corpus file" if os.path.isfile(path) else
                                 "corpus file missing", "rebuild the corpus with "
                                 "tools/build_corpus.py (raise --max-mb-per-domain)")


def preprocess(config: PreprocessConfig, progress: Optional[Progress] = None) -> dict:
    """Tokenize every domain/split of the corpus; return the metadata written."""
    progress = progress or (lambda msg: None)
    manifest = load_manifest(config.corpus_dir)
    _check_corpus_files(config.corpus_dir, manifest)
    os.makedirs(config.out_dir, exist_ok=True)
    tokenizer = _make_tokenizer(config, manifest, progress)
    prefixes = {}
    for domain in manifest["domains"]:
        for split in SPLITS:
            start = time.time()
            prefix = os.path.join(config.out_dir, prefix_name(domain, split))
            name = f"{domain}/{split}"
            docs = _token_lists(tokenizer, iter_texts(config.corpus_dir, domain, split),
                                config.batch_docs, lambda n: progress(f"{name}: {n} docs..."))
            if write_indexed(prefix, docs, tokenizer.eod, tokenizer.vocab_size) == 0:
                raise data_error(os.path.join(config.corpus_dir, f"{domain}.{split}.jsonl"),
                                 "empty corpus file", "rebuild the corpus with "
                                 "tools/build_corpus.py (raise --max-mb-per-domain)")
            stats = check_indexed(prefix, tokenizer.vocab_size)
            prefixes[f"{domain}.{split}"] = {
                "prefix": prefix_name(domain, split), "documents": stats.documents,
                "tokens": stats.tokens, "dtype": stats.dtype,
                "bin_bytes": stats.bin_bytes, "idx_bytes": stats.idx_bytes}
            progress(f"{name}: {stats.documents} docs, {stats.tokens} tokens "
                     f"({time.time() - start:.1f} s)")
    corpus = {"dir": os.path.abspath(config.corpus_dir),
              "sha256": {k: v["sha256"] for k, v in manifest["files"].items()}}
    write_meta(config.out_dir, tokenizer.metadata(), prefixes, corpus)
    return {"tokenizer": tokenizer.metadata(), "prefixes": prefixes, "corpus": corpus}
