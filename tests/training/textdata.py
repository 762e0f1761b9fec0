"""A small real-text token set for training tests: two domains (Python docs = tech,
Jargon File = reference), a 512-token byte-level BPE trained on them, written as
`<domain>_<split>.npy` (the `tokens` data kind). Built once per directory, ~2 s."""

from __future__ import annotations

import glob
import gzip
import os

import numpy as np

VOCAB = 512
_SOURCES = {
    "tech": lambda: "\n".join(open(p, errors="ignore").read() for p in sorted(
        glob.glob("/usr/share/doc/python3.11/html/_sources/tutorial/*.rst.txt"))),
    "reference": lambda: gzip.open("/usr/share/dictd/jargon.dict.dz", "rt",
                                   errors="ignore").read(),
}
MAX_CHARS = 300_000


def build_token_dir(out_dir: str) -> str:
    """Write tech/reference train/valid .npy token files into out_dir (idempotent)."""
    if os.path.exists(os.path.join(out_dir, "done")):
        return out_dir
    from tokenizers import ByteLevelBPETokenizer

    os.makedirs(out_dir, exist_ok=True)
    texts = {d: load()[:MAX_CHARS] for d, load in _SOURCES.items()}
    splits = {d: (t[: int(len(t) * 0.9)], t[int(len(t) * 0.9):]) for d, t in texts.items()}
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([s[0] for s in splits.values()], vocab_size=VOCAB,
                            min_frequency=2, special_tokens=["<|endoftext|>"])
    for domain, (train, valid) in splits.items():
        for split, text in (("train", train), ("valid", valid)):
            ids = np.asarray(tok.encode(text).ids, dtype=np.int32)
            np.save(os.path.join(out_dir, f"{domain}_{split}.npy"), ids)
    open(os.path.join(out_dir, "done"), "w").close()
    return out_dir


def build_megatron_prefixes(out_dir: str) -> dict:
    """The same two domains as Megatron-LM users bring them: `<domain>_text_document`
    .bin/.idx prefixes written by Megatron-Core's own IndexedDatasetBuilder (one document
    per blank-line paragraph, EOD appended), the 512-token BPE as a HF tokenizer.json, and
    the raw text as JSONL ({"text": ...} per line). Idempotent; returns the paths."""
    import json

    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tokenizers import ByteLevelBPETokenizer

    paths = {d: os.path.join(out_dir, f"{d}_text_document") for d in _SOURCES}
    paths["tokenizer"] = os.path.join(out_dir, "tokenizer.json")
    paths["jsonl"] = {d: os.path.join(out_dir, f"{d}.jsonl") for d in _SOURCES}
    if os.path.exists(os.path.join(out_dir, "done")):
        return paths
    os.makedirs(out_dir, exist_ok=True)
    texts = {d: load()[:MAX_CHARS] for d, load in _SOURCES.items()}
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator(list(texts.values()), vocab_size=VOCAB, min_frequency=2,
                            special_tokens=["<|endoftext|>"])
    tok.save(paths["tokenizer"])
    eod = tok.token_to_id("<|endoftext|>")
    for domain, text in texts.items():
        docs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 40]
        builder = IndexedDatasetBuilder(paths[domain] + ".bin",
                                        dtype=DType.optimal_dtype(tok.get_vocab_size()))
        for enc in tok.encode_batch(docs):
            builder.add_document(enc.ids + [eod], [len(enc.ids) + 1])
        builder.finalize(paths[domain] + ".idx")
        with open(paths["jsonl"][domain], "w") as fh:
            for doc in docs:
                fh.write(json.dumps({"text": doc}) + "\n")
    open(os.path.join(out_dir, "done"), "w").close()
    return paths
