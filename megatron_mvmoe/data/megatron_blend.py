"""Megatron-LM's data conventions, through Megatron-Core's own dataset builders.

What a Megatron-LM user passes, and what it becomes here:
- `--data-path A B` or `--data-path 0.3 A 0.7 B` (prefixes of `.bin/.idx` pairs written by
  Megatron's IndexedDatasetBuilder, e.g. Megatron-LM's tools/preprocess_data.py), with
  `--split 969,30,1`: one blend, every split drawn from the same prefixes
  (`megatron.core.datasets.utils.get_blend_from_list`, `GPTDatasetConfig.split`).
- `--train-data-path/--valid-data-path/--test-data-path`: a blend per split.
- `--data-cache-path`: where GPTDataset caches its sample indices.
- `--mock-data`: Megatron-Core's MockGPTDataset (no files).

Design choices:
- The train blend is one `BlendedMegatronDatasetBuilder` call (Megatron's BlendedDataset
  and GPTDataset). Evaluation is per blend component: the same builder, called once per
  prefix with the same split string, gives that prefix's validation split with exactly
  the document boundaries the blend uses; its name is the prefix's file name, so the
  domains come from the data, not from a list in the code.
- Each component is evaluated on the same first `eval_samples` samples every time.
- Every prefix is checked first (`check_indexed`: sizes against the index, ids below the
  model's vocabulary), so a bad file fails at start-up naming the file and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder,
)
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.datasets.utils import get_blend_from_list

from megatron_mvmoe.data.indexed import check_indexed
from megatron_mvmoe.data.loader import _process_group_for_build

if TYPE_CHECKING:  # annotation only: the data package builds on nothing of the trainer
    from megatron_mvmoe.config.run_config import DataSection

DEFAULT_SPLIT = "969, 30, 1"  # Megatron-LM's default --split

Blend = Tuple[List[str], Optional[List[float]]]


PATH_FLAGS = {"path": "--data-path", "train_path": "--train-data-path",
              "valid_path": "--valid-data-path", "test_path": "--test-data-path"}
"""DataSection field -> the Megatron-LM flag that sets it (named in error messages)."""


def _tokens(data: DataSection, name: str) -> List[str]:
    """The tokens of one path field (`path` is None or a list under these conventions)."""
    return list(getattr(data, name) or [])


def check_sources(data: DataSection) -> None:
    """Exactly one of --data-path, per-split paths, --mock-data; blends well formed."""
    per_split = data.train_path or data.valid_path or data.test_path
    sources = sum([bool(_tokens(data, "path")), bool(per_split), data.mock])
    if sources != 1:
        raise ValueError("data: give exactly one of --data-path, --train-data-path/"
                         "--valid-data-path/--test-data-path, --mock-data (got "
                         f"{sources}). Fix: keep one of them")
    if per_split and data.split is not None:
        raise ValueError("data.split: --split applies to --data-path only (Megatron-LM "
                         "rejects it with per-split paths). Fix: drop --split")
    if per_split and not data.train_path:
        raise ValueError("data.train_path: per-split paths need --train-data-path. "
                         "Fix: add it")
    for name in PATH_FLAGS:
        _blend(_tokens(data, name), name)


def _blend(tokens: Sequence[str], name: str) -> Optional[Blend]:
    """Megatron's reading: weight prefix pairs when every other entry is a number, else
    prefixes only; a mix of both (a weight missing) is refused."""
    if not tokens:
        return None
    tokens = [str(t) for t in tokens]
    numeric = [is_number(t) for t in tokens]
    pairs = len(tokens) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2])
    if any(numeric) and not pairs:
        raise ValueError(f"{PATH_FLAGS[name]}: {tokens} mixes weights and prefixes "
                         "but is not weight prefix pairs. Fix: 'W1 PREFIX1 W2 PREFIX2 ...' "
                         "or prefixes only")
    return get_blend_from_list(tokens)


def is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def component_names(prefixes: Sequence[str]) -> List[str]:
    """File names of the prefixes, made unique with their parent directory if needed."""
    names = [os.path.basename(p.rstrip("/")) for p in prefixes]
    if len(set(names)) == len(names):
        return names
    return [os.path.join(os.path.basename(os.path.dirname(p)), n) for p, n in
            zip(prefixes, names)]


@dataclass
class MegatronDatasets:
    train: object
    """Megatron's BlendedDataset (or one GPTDataset for a single prefix)."""
    valid: Dict[str, object]
    """Component name -> that component's validation GPTDataset."""


def _config(data: DataSection, tokenizer, seq_length: int, seed: int, **blend):
    first = (blend.get("blend") or (blend.get("blend_per_split") or [None])[0] or [[""]])[0][0]
    cache = data.cache_path or (os.path.join(os.path.dirname(first) or ".", "cache")
                                if first else None)
    return GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, tokenizer=tokenizer,
        path_to_cache=cache, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, create_attention_mask=False, **blend)


def _build(cls, sizes, config):
    return BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()


def check_prefixes_exist(data: DataSection) -> None:
    """Every prefix of every path flag has its .bin and .idx: checked before the tokenizer is
    looked for beside them, so a mistyped --data-path is named as such."""
    for name in PATH_FLAGS:
        tokens = getattr(data, name)
        blend = _blend(tokens, name) if isinstance(tokens, (list, tuple)) else None
        for prefix in (blend[0] if blend else []):
            missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                raise ValueError(f"{PATH_FLAGS[name]}: data prefix {prefix!r} not found (no "
                                 f"{' or '.join(prefix + ext for ext in missing)}). Fix: pass "
                                 "the path of a .bin/.idx pair without its extension, e.g. "
                                 "<--output-prefix of tools/preprocess_data.py>_text_document")


def check_prefixes(data: DataSection, vocab_size: int) -> None:
    for name in PATH_FLAGS:
        blend = _blend(_tokens(data, name), name)
        for prefix in (blend[0] if blend else []):
            check_indexed(prefix, vocab_size=vocab_size)


def build_megatron_datasets(data: DataSection, tokenizer, seq_length: int, seed: int,
                            train_samples: int, eval_samples: int,
                            vocab_size: int) -> MegatronDatasets:
    """Train blend + per-component validation sets (collective: call on every rank)."""
    check_sources(data)
    if not data.mock:
        check_prefixes(data, vocab_size)
    train_samples = max(1, train_samples)
    with _process_group_for_build():
        if data.mock:
            config = _config(data, tokenizer, seq_length, seed, split="1,1,1")
            train, valid, _ = _build(MockGPTDataset, [train_samples, eval_samples, 1], config)
            return MegatronDatasets(train=train, valid={"mock": valid})
        if _tokens(data, "path"):
            return _from_one_blend(data, tokenizer, seq_length, seed, train_samples,
                                   eval_samples)
        return _from_split_blends(data, tokenizer, seq_length, seed, train_samples,
                                  eval_samples)


def _only_split(config: GPTDatasetConfig, keep: int) -> GPTDatasetConfig:
    """Build only split `keep`: the other book-ends become None, so the kept one has the
    same documents it has in the full split (and Megatron never builds an empty split,
    whose epoch count would never reach the requested samples)."""
    config.split_matrix = [bounds if i == keep else None
                           for i, bounds in enumerate(config.split_matrix)]
    return config


def _check_split_nonempty(prefix: str, bounds, documents: int, split: str, what: str):
    begin, end = (int(round(b * float(documents))) for b in bounds)
    if end <= begin:
        raise ValueError(f"data.split: {split!r} leaves the {what} split of {prefix} without "
                         f"documents ({documents} documents). Fix: a larger {what} weight in "
                         "--split, more documents, or --valid-data-path")


def _from_one_blend(data, tokenizer, seq_length, seed, train_samples, eval_samples):
    split = data.split or DEFAULT_SPLIT
    blend = _blend(_tokens(data, "path"), "path")
    config = _only_split(_config(data, tokenizer, seq_length, seed, blend=blend, split=split), 0)
    for prefix in blend[0]:
        _check_split_nonempty(prefix, config.split_matrix[0], check_indexed(prefix).sequences,
                              split, "train")
    train = _build(GPTDataset, [train_samples, 0, 0], config)[0]
    valid = {}
    for name, prefix in zip(component_names(blend[0]), blend[0]):
        one = _config(data, tokenizer, seq_length, seed, blend=([prefix], None), split=split)
        if one.split_matrix[1] is None:
            continue  # --split gives validation no weight: nothing to evaluate
        _check_split_nonempty(prefix, one.split_matrix[1], check_indexed(prefix).sequences,
                              split, "validation")
        valid[name] = _build(GPTDataset, [0, eval_samples, 0], _only_split(one, 1))[1]
    return MegatronDatasets(train=train, valid=valid)


def _from_split_blends(data, tokenizer, seq_length, seed, train_samples, eval_samples):
    train_blend = _blend(_tokens(data, "train_path"), "train_path")
    config = _config(data, tokenizer, seq_length, seed,
                     blend_per_split=[train_blend, None, None])
    train = _build(GPTDataset, [train_samples, None, None], config)[0]
    valid = {}
    valid_blend = _blend(_tokens(data, "valid_path"), "valid_path")
    for name, prefix in zip(component_names(valid_blend[0]) if valid_blend else [],
                            valid_blend[0] if valid_blend else []):
        one = _config(data, tokenizer, seq_length, seed,
                      blend_per_split=[None, ([prefix], None), None])
        valid[name] = _build(GPTDataset, [None, eval_samples, None], one)[1]
    return MegatronDatasets(train=train, valid=valid)
