"""Microbatch streams of one run for training and per-domain evaluation (the trainer's
data, and the analysis tools' held-out batches: one code path).

Design choices:
- Takes the run's `RunConfig` (config/run_config.py, imported for annotations only). Read: `run.data`, `run.model.vocab_size`,
  `run.parallel.tp` and `run.training` (micro/global batch, train/eval iters, seed).
- `indexed` (the real path): Megatron GPTDataset / BlendedDataset over the .bin/.idx files
  of tools/preprocess_data.py, through `megatron_mvmoe.data.loader` (Megatron's pretraining
  sampler order, resumable from `consumed_samples`); or, given the Megatron-LM way
  (`--data-path` prefixes/blends, per-split paths, `--mock-data`), through
  `megatron_mvmoe.data.megatron_blend`, evaluated per blend component.
- `with_tokenizer_vocab` runs before the model is built (training/startup.py): the
  tokenizer chosen by `--tokenizer-type` (or the one saved beside preprocessed prefixes)
  fixes the model's vocabulary, padded as Megatron-LM pads it, unless the run sets a large
  enough one; the run it is given is left unchanged, and the tokenizer it builds is the
  one the data reads with (`RunData(..., tokenizer=)`).
- `data.loader: dali` feeds the train microbatches through a DALI pipeline (same samples,
  same order); evaluation always reads through torch.
- `tokens` (tests, tiny demos): `<domain>_<split>.npy` int token arrays cut into
  consecutive seq_length + 1 windows; the train blend interleaves domains round-robin.
  Same batch dict as GPTDataset, and the same one sampler (`loader.microbatches`, wrapping
  past the end: each DP rank its slice of every micro_batch_size * dp block), so the loop
  cannot tell the two apart.
- Every pipeline stage draws the same microbatches (first stage reads tokens, last stage
  labels), so no batch broadcast between stages is needed.
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

from megatron_mvmoe.data.loader import microbatches

if TYPE_CHECKING:
    from megatron_mvmoe.config.run_config import RunConfig


def _saved_tokenizer_dir(run: "RunConfig") -> Optional[str]:
    """tokenizer/ beside the first prefix (written by tools/preprocess_data.py), if any."""
    d = run.data
    tokens = list(d.path) if isinstance(d.path, (list, tuple)) else []
    tokens = tokens or list(d.train_path) or list(d.valid_path)
    from megatron_mvmoe.data.megatron_blend import is_number

    prefixes = [t for t in tokens if not is_number(str(t))]
    if not prefixes:
        return None
    candidate = os.path.join(os.path.dirname(prefixes[0]), "tokenizer")
    return candidate if os.path.isfile(os.path.join(candidate, "vocab.json")) else None


def build_run_tokenizer(run: "RunConfig"):
    """The run's tokenizer (Megatron-LM conventions), or None for our directory layout."""
    from megatron_mvmoe.data.tokenizers import build_tokenizer

    from megatron_mvmoe.data.megatron_blend import check_prefixes_exist

    d = run.data
    if d.megatron_conventions():
        check_prefixes_exist(d)
    if d.tokenizer_type is None:
        if not d.megatron_conventions():
            return None
        saved = _saved_tokenizer_dir(run)
        if saved is None:
            raise ValueError("data.tokenizer_type: not set, and no tokenizer/ beside the "
                             "data. Fix: --tokenizer-type GPT2BPETokenizer --vocab-file F "
                             "--merge-file F (or HuggingFaceTokenizer --tokenizer-model P, "
                             "or NullTokenizer --vocab-size N)")
        return build_tokenizer("HuggingFaceTokenizer", tokenizer_model=saved)
    return build_tokenizer(d.tokenizer_type, d.vocab_file, d.merge_file, d.tokenizer_model,
                           d.null_vocab_size)


def _given_padded_vocab(padded: int, tokenizer_vocab: int, tp: int) -> int:
    """data.padded_vocab_size, checked: every token id needs a row, and Megatron's
    vocab-parallel embedding splits the rows evenly over TP."""
    if padded < tokenizer_vocab or padded % tp:
        raise ValueError(f"data.padded_vocab_size (--padded-vocab-size): {padded} must be at "
                         f"least the tokenizer's vocabulary {tokenizer_vocab} and a multiple "
                         f"of TP {tp}. Fix: raise it, or drop it (the vocabulary is then "
                         "padded by --make-vocab-size-divisible-by)")
    return padded


def with_tokenizer_vocab(run: "RunConfig") -> Tuple["RunConfig", Optional[object]]:
    """(the run with its tokenizer's vocabulary, the tokenizer); `run` itself is left as
    given (a copy carries the change). model.vocab_size is the tokenizer's, padded as
    Megatron-LM pads it, unless the run sets a large enough one; with NullTokenizer the
    run's --vocab-size is the tokenizer's (Megatron-LM's meaning), moved to
    data.null_vocab_size. Without a tokenizer (our directory layout): `run`, None."""
    from megatron_mvmoe.data.tokenizers import padded_vocab_size

    if run.data.tokenizer_type == "NullTokenizer" and run.data.null_vocab_size is None:
        run = copy.deepcopy(run)
        run.data.null_vocab_size, run.model.vocab_size = run.model.vocab_size, None
    tokenizer = build_run_tokenizer(run)
    if tokenizer is None:
        return run, None
    vocab = run.model.vocab_size
    if run.data.padded_vocab_size is not None:  # Megatron-LM: it is the model's, whatever else
        run = copy.deepcopy(run)
        run.model.vocab_size = _given_padded_vocab(run.data.padded_vocab_size,
                                                   tokenizer.vocab_size, run.parallel.tp)
    elif vocab is None:
        run = copy.deepcopy(run)
        run.model.vocab_size = padded_vocab_size(
            tokenizer.vocab_size, run.data.make_vocab_size_divisible_by, run.parallel.tp)
    elif vocab < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size: {vocab} is below the tokenizer's "
                         f"{tokenizer.vocab_size}. Fix: drop --vocab-size, or --unset "
                         "model.vocab_size when the YAML or the preset sets it (it is then the "
                         "tokenizer's, padded), or raise it")
    return run, tokenizer


def resolve_tokenizer(run: "RunConfig"):
    """The tools' form of `with_tokenizer_vocab` (a tool session holds one run it built for
    itself): the vocabulary written into `run`; returns the tokenizer. The trainer's start-up
    (training/startup.py) leaves its run unchanged."""
    resolved, tokenizer = with_tokenizer_vocab(run)
    run.model.vocab_size = resolved.model.vocab_size
    run.data.null_vocab_size = resolved.data.null_vocab_size
    return tokenizer


class TokenWindows(torch.utils.data.Dataset):
    """seq_length + 1 token windows of one or more token arrays, domains interleaved."""

    def __init__(self, arrays: List[np.ndarray], seq_length: int) -> None:
        self.seq_length = seq_length
        self.arrays = arrays
        self.counts = [max(0, (len(a) - 1) // seq_length) for a in arrays]
        if min(self.counts, default=0) == 0:
            raise ValueError(f"data: a token file holds fewer than seq_length+1 = "
                             f"{seq_length + 1} tokens. Fix: more text or a shorter seq_length")

    def __len__(self) -> int:
        return min(self.counts) * len(self.arrays)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        array = self.arrays[index % len(self.arrays)]
        window = index // len(self.arrays)
        start = window * self.seq_length
        chunk = torch.from_numpy(array[start:start + self.seq_length + 1].astype(np.int64))
        return {"tokens": chunk[:-1], "labels": chunk[1:],
                "loss_mask": torch.ones(self.seq_length),
                "position_ids": torch.arange(self.seq_length)}


class RunData:
    """Train and per-domain eval microbatch iterators of one run on one DP rank."""

    def __init__(self, run: "RunConfig", seq_length: int, vocab_size: int, dp_rank: int,
                 dp_size: int, tokenizer=None) -> None:
        """`tokenizer`: the run's, when the caller built it (the trainer's start-up);
        otherwise built here when the data needs it (Megatron-LM conventions)."""
        self.run, self.seq_length, self.vocab_size = run, seq_length, vocab_size
        self.tokenizer = tokenizer
        self.dp_rank, self.dp_size = dp_rank, dp_size
        if run.data.megatron_conventions():
            self.train, self.valid = self._build_megatron()
            self.domains = list(self.valid)
            return
        if run.data.path is None:
            raise ValueError("data.path: not set. Fix: --data-path <preprocessed dir>")
        if not os.path.isdir(run.data.path):
            raise ValueError(f"data.path: {run.data.path!r} is not a directory. Fix: run "
                             "tools/preprocess_data.py or pass the right --data-path")
        build = self._build_indexed if run.data.kind == "indexed" else self._build_tokens
        self.train, self.valid = build()
        self.domains = list(self.valid)

    # ----------------------------------------------------------------- builders
    def _domains(self, available: List[str]) -> List[str]:
        wanted = list(self.run.data.train_blend) or available
        missing = sorted(set(wanted) - set(available))
        if missing:
            raise ValueError(f"data.train_blend: domains {missing} not found in "
                             f"{self.run.data.path}. Fix: use some of {available}")
        return wanted

    def _build_tokens(self):
        path = self.run.data.path
        available = sorted(f[:-len("_train.npy")] for f in os.listdir(path)
                           if f.endswith("_train.npy"))
        domains = self._domains(available)

        def load(domain, split):
            array = np.load(os.path.join(path, f"{domain}_{split}.npy"), mmap_mode="r")
            if array.size and int(array.max()) >= self.vocab_size:
                raise ValueError(f"data: {domain}_{split}.npy has token id {int(array.max())} "
                                 f">= model vocab_size {self.vocab_size}. Fix: --vocab-size")
            return np.asarray(array)

        train = TokenWindows([load(d, "train") for d in domains], self.seq_length)
        eval_domains = self.run.data.eval_domains or domains
        valid = {d: TokenWindows([load(d, "valid")], self.seq_length) for d in eval_domains}
        return train, valid

    def _build_indexed(self):
        from megatron_mvmoe.data.loader import DataConfig, build_datasets

        t = self.run.training
        blend = self.run.data.train_blend
        config = DataConfig(
            data_dir=self.run.data.path, seq_length=self.seq_length,
            micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
            # --train-iters 0 (evaluate and save the initial model) reads no training
            # sample; Megatron's dataset builder still wants a positive count.
            train_samples=max(1, t.train_iters) * t.global_batch_size, seed=t.seed,
            create_attention_mask=False,
            **({"domains": tuple(blend), "domain_weights": list(blend.values())}
               if blend else {}))
        bundle = build_datasets(config, model_vocab_size=self.vocab_size)
        eval_domains = self.run.data.eval_domains or list(bundle.valid)
        return bundle.train, {d: bundle.valid[d] for d in eval_domains}

    def _build_megatron(self):
        from megatron_mvmoe.data.megatron_blend import build_megatron_datasets

        d, t = self.run.data, self.run.training
        bundle = build_megatron_datasets(
            d, self.tokenizer if self.tokenizer is not None else build_run_tokenizer(self.run),
            self.seq_length, t.seed,
            train_samples=t.train_iters * t.global_batch_size,
            eval_samples=max(1, t.eval_iters) * t.global_batch_size,
            vocab_size=self.vocab_size)
        wanted = d.eval_domains or list(bundle.valid)
        missing = sorted(set(wanted) - set(bundle.valid))
        if missing:
            raise ValueError(f"data.eval_domains: {missing} are not components of the data. "
                             f"Fix: use some of {list(bundle.valid)}")
        return bundle.train, {name: bundle.valid[name] for name in wanted}

    # ----------------------------------------------------------------- iterators
    def train_iterator(self, consumed_samples: int) -> Iterator:
        mbs = self.run.training.micro_batch_size
        if self.run.data.loader == "dali":
            from megatron_mvmoe.data.dali_loader import dali_microbatches

            return dali_microbatches(self.train, mbs, self.dp_rank, self.dp_size,
                                     consumed_samples)
        return microbatches(self.train, mbs, self.dp_rank, self.dp_size, consumed_samples,
                            wrap=True)

    def eval_iterator(self, domain: str) -> Iterator:
        """Always the same held-out microbatches (from the start of the domain's set)."""
        return microbatches(self.valid[domain], self.run.training.micro_batch_size,
                            self.dp_rank, self.dp_size, wrap=True)


def to_device(batch: Dict[str, Optional[torch.Tensor]], device) -> Dict[str, torch.Tensor]:
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v)
            for k, v in batch.items()}
