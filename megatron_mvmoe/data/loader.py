"""Train/valid/test datasets through Megatron-Core's dataset stack, and microbatch iterators.

Design choices:
- Datasets are Megatron's own: `BlendedMegatronDatasetBuilder` + `GPTDataset`, from the
  .bin/.idx files of tools/preprocess_data.py. Train blends the domains' train files
  (equal weights unless given); validation and test are built per domain, one full
  epoch each unless a sample count is given, so each domain gets its own perplexity.
- Before Megatron touches a file, every prefix is checked (`check_indexed`: sizes
  against the index, ids below the model's vocab) and the dataset's tokenizer metadata
  is compared with the model's vocab size (`check_vocab`): mistakes fail at start-up
  with the file and the fix named.
- Distributed: the builder itself builds caches on rank 0 first, then barriers, then
  the other ranks load them. Megatron's BlendedDataset cache needs torch.distributed,
  so in a single process without a process group (a notebook, a test) a 1-rank gloo
  group is created for the build only and destroyed afterwards.
- Microbatches follow Megatron's pretraining sampler: consecutive global sample ids,
  each data-parallel rank taking its `micro_batch_size` slice of every
  `micro_batch_size * dp_size` block, resumable from `consumed_samples`. This is the one
  sampler: the trainer's train and eval iterators (run_data.RunData) are `microbatches`
  with `wrap=True` (past the end, sample ids continue modulo the dataset size).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import tempfile
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

from megatron_mvmoe.data.indexed import check_indexed, check_vocab, read_meta
from megatron_mvmoe.data.preprocess import TOKENIZER_DIR, prefix_name
from megatron_mvmoe.data.tokenize import Tokenizer, load_tokenizer

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


@dataclass
class DataConfig:
    """What the training loop asks of the data."""

    data_dir: str
    """Output directory of tools/preprocess_data.py (holds dataset_meta.json)."""

    seq_length: int
    """Tokens per sample (inputs); each sample reads seq_length + 1 tokens."""

    micro_batch_size: int
    """Samples per microbatch on one data-parallel rank."""

    global_batch_size: int
    """Samples per optimizer step over all data-parallel ranks."""

    train_samples: int
    """Samples the train blend must provide (train_iters * global_batch_size)."""

    eval_samples: Optional[int] = None
    """Samples per domain for valid/test; None = one full epoch of each held-out file."""

    seed: int = 1234
    """Seed of Megatron's sample shuffling and blending."""

    domains: Optional[tuple] = None
    """Domains to train and evaluate on (None = every domain in the directory's
    dataset_meta.json: the names come from the data)."""

    domain_weights: Optional[List[float]] = None
    """Train blend weights, one per domain; None = equal weights."""

    cache_dir: str = ""
    """Where Megatron caches its sample indices ('' = <data_dir>/cache)."""

    create_attention_mask: bool = True
    """Return the [1, S, S] causal mask (True = masked); off when attention builds its own."""

    eod_mask_loss: bool = False
    """Mask the loss on EOD tokens."""

    def __post_init__(self) -> None:
        for name in ("seq_length", "micro_batch_size", "global_batch_size", "train_samples"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not a multiple "
                             f"of micro_batch_size={self.micro_batch_size}. Fix: make it one")
        if self.domain_weights is not None and self.domains is not None and \
                len(self.domain_weights) != len(self.domains):
            raise ValueError(f"domain_weights has {len(self.domain_weights)} entries for "
                             f"{len(self.domains)} domains. Fix: one weight per domain")


@dataclass
class DataBundle:
    """The tokenizer and datasets of one run."""

    tokenizer: Tokenizer
    train: GPTDataset
    """The train blend (a BlendedDataset: its samples also carry `dataset_id`, the
    index of the domain in DataConfig.domains)."""
    valid: Dict[str, GPTDataset] = field(default_factory=dict)
    test: Dict[str, GPTDataset] = field(default_factory=dict)


def _prefix(config: DataConfig, domain: str, split: str) -> str:
    return os.path.join(config.data_dir, prefix_name(domain, split))


def check_data(config: DataConfig, model_vocab_size: int, tokenizer: Tokenizer) -> None:
    """Fail before training on a missing/corrupt file or a tokenizer/vocab mismatch."""
    meta = read_meta(config.data_dir)
    check_vocab(meta, model_vocab_size, tokenizer.metadata(),
                where=os.path.join(config.data_dir, "dataset_meta.json"))
    for domain in config.domains:
        for split in ("train", "valid", "test"):
            check_indexed(_prefix(config, domain, split), vocab_size=model_vocab_size)


def gpt_dataset_config(config: DataConfig, tokenizer: Tokenizer,
                       blend_per_split) -> GPTDatasetConfig:
    cache = config.cache_dir or os.path.join(config.data_dir, "cache")
    return GPTDatasetConfig(
        random_seed=config.seed, sequence_length=config.seq_length,
        blend_per_split=blend_per_split, tokenizer=tokenizer,
        path_to_cache=cache,
        reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=config.eod_mask_loss, create_attention_mask=config.create_attention_mask)


@contextlib.contextmanager
def _process_group_for_build():
    """A 1-rank gloo group for the duration of the build, unless one already exists."""
    if torch.distributed.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = torch.distributed.FileStore(os.path.join(tmp, "store"), 1)
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            torch.distributed.destroy_process_group()


def _build(config, tokenizer, blend_per_split, sizes):
    gpt_config = gpt_dataset_config(config, tokenizer, blend_per_split)
    builder = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, gpt_config)
    return builder.build()


def build_datasets(config: DataConfig, model_vocab_size: Optional[int] = None) -> DataBundle:
    """Check the files, then build the train blend and per-domain valid/test datasets.

    Collective when torch.distributed is initialised: call it on every rank.
    """
    meta = read_meta(config.data_dir)
    config = dataclasses.replace(config, domains=_domains_in(config, meta))
    tokenizer = load_tokenizer(os.path.join(config.data_dir, TOKENIZER_DIR),
                               meta["tokenizer"]["kind"])
    check_data(config, model_vocab_size or tokenizer.vocab_size, tokenizer)
    with _process_group_for_build():
        return _build_bundle(config, tokenizer)


def _domains_in(config: DataConfig, meta: dict) -> tuple:
    """The requested domains, checked against those the directory holds (in its order)."""
    available = tuple(dict.fromkeys(key.split(".")[0] for key in meta["prefixes"]))
    unknown = sorted(set(config.domains or ()) - set(available))
    if unknown:
        raise ValueError(f"domains={config.domains}: {unknown} not in {config.data_dir}. "
                         f"Fix: use some of {available}")
    if config.domain_weights is not None and len(config.domain_weights) != \
            len(config.domains or available):
        raise ValueError(f"domain_weights has {len(config.domain_weights)} entries for "
                         f"{len(config.domains or available)} domains. Fix: one per domain")
    return tuple(config.domains or available)


def _build_bundle(config: DataConfig, tokenizer: Tokenizer) -> DataBundle:
    weights = config.domain_weights or [1.0] * len(config.domains)
    train_blend = ([_prefix(config, d, "train") for d in config.domains], weights)
    train = _build(config, tokenizer, [train_blend, None, None],
                   [config.train_samples, None, None])[0]
    bundle = DataBundle(tokenizer=tokenizer, train=train)
    for domain in config.domains:
        per_split = [None, ([_prefix(config, domain, "valid")], None),
                     ([_prefix(config, domain, "test")], None)]
        _, valid, test = _build(config, tokenizer, per_split,
                                [None, config.eval_samples, config.eval_samples])
        bundle.valid[domain], bundle.test[domain] = valid, test
    return bundle


# ---------------------------------------------------------------------------- batches


class PretrainingSampler:
    """Megatron's pretraining order: consecutive samples, each DP rank its slice.

    `wrap`: endless; past the end of the dataset the sample ids continue modulo its size
    (what a run whose steps need more samples than the dataset holds reads, and the
    held-out iterators of an evaluation longer than the held-out set)."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, drop_last: bool = True, wrap: bool = False):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} not in [0, dp_size={dp_size})")
        if total_samples <= 0:
            raise ValueError(f"total_samples={total_samples}: the dataset is empty. Fix: "
                             "more data, or a shorter seq_length")
        self.total, self.consumed = total_samples, consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.drop_last, self.wrap = drop_last, wrap

    def __len__(self) -> int:
        if self.wrap:
            raise TypeError("a wrapping PretrainingSampler is endless: it has no length")
        return (self.total - self.consumed) // (self.mbs * self.dp_size)

    def batch_at(self, k: int) -> Optional[List[int]]:
        """This rank's k-th microbatch of sample ids (None past the last full block,
        unless `wrap`)."""
        block = self.mbs * self.dp_size
        first = self.consumed + k * block
        start = first + self.dp_rank * self.mbs
        if self.wrap:
            return [(start + i) % self.total for i in range(self.mbs)]
        if first + block > self.total:
            return None
        return list(range(start, start + self.mbs))

    def __iter__(self) -> Iterator[List[int]]:
        if self.wrap:
            yield from map(self.batch_at, itertools.count())
            return
        for k in range(len(self)):
            yield self.batch_at(k)
        block = self.mbs * self.dp_size
        tail_start = self.consumed + len(self) * block + self.dp_rank * self.mbs
        if not self.drop_last and tail_start < self.total:
            yield list(range(tail_start, min(tail_start + self.mbs, self.total)))


def collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """torch's default collate, except a shared attention mask is expanded, not copied.

    GPTDataset returns one cached causal mask for every sample when positions and masks
    are not reset; stacking B copies of a [1, S, S] mask is wasted memory and, on a
    loaded 2-core machine with 2 OpenMP threads, took ~0.1 s per microbatch.
    """
    masks = [s.get("attention_mask") for s in samples]
    # A blend draws from one GPTDataset per domain: equal masks, different objects.
    # Compared in numpy: torch's 2-thread kernels stall when the other core is busy.
    shared = masks[0] is not None and all(
        m is masks[0] or np.array_equal(m.numpy(), masks[0].numpy()) for m in masks)
    rest = [{k: v for k, v in s.items() if not (shared and k == "attention_mask")}
            for s in samples]
    batch = torch.utils.data.default_collate(rest)
    if shared:
        batch["attention_mask"] = masks[0].unsqueeze(0).expand(len(samples), *masks[0].shape)
    return batch


def microbatches(dataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 consumed_samples: int = 0, num_workers: int = 0,
                 drop_last: bool = True, wrap: bool = False
                 ) -> Iterator[Dict[str, torch.Tensor]]:
    """Microbatches of `dataset` for one DP rank: dicts of [B, S] tensors (and the
    [B, 1, S, S] bool attention_mask, True = masked, when the dataset makes one; it may
    be a zero-copy expand of one shared mask: clone it before writing into it).
    `wrap`: endless, past the end the sample ids continue modulo len(dataset)."""
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 dp_rank, dp_size, drop_last, wrap)
    # A private generator: starting a DataLoader iterator draws a worker base seed, which
    # from torch's global generator would shift the run's random stream (dropout, and the
    # bit-identity of a resumed run, whose iterators start at a different point).
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                         num_workers=num_workers, collate_fn=collate,
                                         generator=torch.Generator())
    return iter(loader)


def num_microbatches(config: DataConfig, dp_size: int) -> int:
    """Microbatches per optimizer step on each data-parallel rank."""
    per_step = config.micro_batch_size * dp_size
    if config.global_batch_size % per_step:
        raise ValueError(f"global_batch_size={config.global_batch_size} is not a multiple of "
                         f"micro_batch_size * dp_size = {per_step}. Fix: change one of them")
    return config.global_batch_size // per_step


def train_microbatches(bundle: DataBundle, config: DataConfig, dp_rank: int = 0,
                       dp_size: int = 1, consumed_samples: int = 0,
                       num_workers: int = 0) -> Iterator[Dict[str, torch.Tensor]]:
    """This rank's train microbatches from `consumed_samples` on (a resumed run passes
    iteration * global_batch_size); num_microbatches(config, dp_size) make one step."""
    num_microbatches(config, dp_size)  # validates the batch arithmetic
    return microbatches(bundle.train, config.micro_batch_size, dp_rank, dp_size,
                        consumed_samples, num_workers)
