"""Assemble the three-domain corpus into JSONL files with disjoint train/valid/test splits.

Design choices:
- The split of a document is a pure function of (seed, source, key): sha256 mapped to
  [0, 1) and cut at the valid / test fractions. No state, no shuffling: the same
  document lands in the same split on every machine and every build, and a held-out
  document can never appear in train.
- `max_mb_per_domain` caps each domain for small runs and tests. The cap is shared
  equally by the domain's sources and, inside a source, by the splits in proportion to
  their fractions; a split keeps taking documents until its share is reached (so every
  split gets at least one document), and a source is read no further once all its
  shares are full.
- Output: `<domain>.<split>.jsonl`, one {"text", "domain", "source"} object per line,
  and `manifest.json` (written last, so its presence means the build completed) with
  sizes, sha256 of every file, per-source counts and the build settings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, Optional

from megatron_mvmoe.data.errors import data_error
from megatron_mvmoe.data.sources import (DOMAINS, SOURCES, Document, SourcePaths,
                                         describe_source, file_sha256)

SPLITS = ("train", "valid", "test")
MANIFEST = "manifest.json"
FORMAT = "megatron_mvmoe.corpus/1"

Progress = Callable[[str], None]


@dataclass
class CorpusConfig:
    """How to build the corpus."""

    out_dir: str
    """Directory receiving the JSONL files and manifest.json (created if missing)."""

    paths: SourcePaths = field(default_factory=SourcePaths)
    """Where the sources are read from."""

    max_mb_per_domain: float = 0.0
    """Cap on the text (UTF-8 MB) taken per domain; 0 takes everything."""

    valid_fraction: float = 0.02
    """Share of documents hashed into the validation split."""

    test_fraction: float = 0.02
    """Share of documents hashed into the test split."""

    split_seed: int = 1234
    """Salt of the split hash: change it to draw a different (still disjoint) split."""

    def __post_init__(self) -> None:
        for name in ("valid_fraction", "test_fraction"):
            value = getattr(self, name)
            if not 0.0 < value < 0.5:
                raise ValueError(f"{name}={value}: must be in (0, 0.5). Fix: pass e.g. 0.02")
        if self.max_mb_per_domain < 0:
            raise ValueError(f"max_mb_per_domain={self.max_mb_per_domain}: must be >= 0 "
                             "(0 = no cap). Fix: pass a positive size in MB")


def split_of(doc: Document, config: CorpusConfig) -> str:
    """The split a document belongs to: a hash of (seed, source, key), never random."""
    digest = hashlib.sha256(f"{config.split_seed}:{doc.source}:{doc.key}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    if u < config.valid_fraction:
        return "valid"
    if u < config.valid_fraction + config.test_fraction:
        return "test"
    return "train"


def split_shares(config: CorpusConfig, sources_in_domain: int) -> Optional[Dict[str, float]]:
    """Bytes each split of one source may take, or None when there is no cap."""
    if config.max_mb_per_domain == 0:
        return None
    per_source = config.max_mb_per_domain * 1e6 / sources_in_domain
    held_out = {"valid": config.valid_fraction, "test": config.test_fraction}
    fractions = {"train": 1.0 - sum(held_out.values()), **held_out}
    return {split: per_source * fractions[split] for split in SPLITS}


class _SplitWriters:
    """The nine JSONL files, with running counts and sha256 per file."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir
        self.files, self.stats = {}, {}
        for domain in DOMAINS:
            for split in SPLITS:
                name = f"{domain}.{split}"
                self.files[name] = open(os.path.join(out_dir, name + ".jsonl"), "wb")
                self.stats[name] = {"path": name + ".jsonl", "docs": 0, "text_bytes": 0}

    def write(self, doc: Document, split: str) -> int:
        line = json.dumps({"text": doc.text, "domain": doc.domain, "source": doc.source},
                          ensure_ascii=False) + "\n"
        name = f"{doc.domain}.{split}"
        self.files[name].write(line.encode("utf-8"))
        text_bytes = len(doc.text.encode("utf-8"))
        self.stats[name]["docs"] += 1
        self.stats[name]["text_bytes"] += text_bytes
        return text_bytes

    def close(self) -> Dict[str, dict]:
        for name, f in self.files.items():
            f.close()
            path = os.path.join(self.out_dir, self.stats[name]["path"])
            self.stats[name]["bytes"] = os.path.getsize(path)
            self.stats[name]["sha256"] = file_sha256(path)
        return self.stats


def _take(docs: Iterator[Document], config: CorpusConfig, shares, writers) -> dict:
    """Write a source's documents to their splits until its shares are full."""
    counts = {split: {"docs": 0, "text_bytes": 0} for split in SPLITS}
    for doc in docs:
        split = split_of(doc, config)
        if shares is not None and counts[split]["text_bytes"] >= shares[split]:
            if all(counts[s]["text_bytes"] >= shares[s] for s in SPLITS):
                break
            continue
        counts[split]["text_bytes"] += writers.write(doc, split)
        counts[split]["docs"] += 1
    return counts


def _check_not_empty(stats: Dict[str, dict], config: CorpusConfig) -> None:
    for name, entry in stats.items():
        if entry["docs"] == 0:
            raise data_error(os.path.join(config.out_dir, entry["path"]),
                             "no documents (empty corpus split)",
                             "check that every source is installed, and raise "
                             "--max-mb-per-domain or the valid/test fractions")


def build_corpus(config: CorpusConfig, progress: Optional[Progress] = None) -> dict:
    """Read every source, write the split JSONL files and the manifest; return it."""
    progress = progress or (lambda msg: None)
    os.makedirs(config.out_dir, exist_ok=True)
    manifest_path = os.path.join(config.out_dir, MANIFEST)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)  # an interrupted rebuild must not look complete
    writers = _SplitWriters(config.out_dir)
    sources = {}
    try:
        for source in SOURCES:
            start = time.time()
            n_in_domain = sum(s.domain == source.domain for s in SOURCES)
            counts = _take(source.read(config.paths), config,
                           split_shares(config, n_in_domain), writers)
            sources[source.name] = {"domain": source.domain, "splits": counts,
                                    **describe_source(source.name, config.paths)}
            mb = sum(c["text_bytes"] for c in counts.values()) / 1e6
            docs = sum(c["docs"] for c in counts.values())
            progress(f"{source.domain}/{source.name}: {docs} docs, {mb:.2f} MB "
                     f"({time.time() - start:.1f} s)")
    finally:
        stats = writers.close()
    _check_not_empty(stats, config)
    manifest = {"format": FORMAT, "config": _config_record(config), "files": stats,
                "sources": sources, "domains": list(DOMAINS), "splits": list(SPLITS)}
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def _config_record(config: CorpusConfig) -> dict:
    record = dataclasses.asdict(config)
    record["split_rule"] = "sha256(f'{split_seed}:{source}:{key}')[:8] / 2**64 vs fractions"
    return record


# ---------------------------------------------------------------------------- reading


def load_manifest(corpus_dir: str) -> dict:
    """The manifest of a built corpus, or a DataError saying how to build one."""
    path = os.path.join(corpus_dir, MANIFEST)
    if not os.path.isfile(path):
        raise data_error(path, "corpus manifest missing (corpus not built, or the build "
                         "was interrupted)", f"run tools/build_corpus.py --out {corpus_dir}")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise data_error(path, f"unknown corpus format {manifest.get('format')!r}",
                         f"rebuild with tools/build_corpus.py --out {corpus_dir}")
    return manifest


def iter_texts(corpus_dir: str, domain: str, split: str) -> Iterator[str]:
    """The document texts of one domain/split file, in file order."""
    path = os.path.join(corpus_dir, f"{domain}.{split}.jsonl")
    if not os.path.isfile(path):
        raise data_error(path, "corpus file missing",
                         f"rebuild with tools/build_corpus.py --out {corpus_dir}")
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            try:
                yield json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise data_error(f"{path}:{line_no}", f"not a JSON object with 'text' "
                                 f"({exc})", "rebuild the corpus with "
                                 "tools/build_corpus.py") from None
