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
