"""The comparison suites' data: the project's Megatron indexed datasets, built on demand.

Design choices:
- tools/compare.py trains through the trainer's `indexed` data kind (Megatron GPTDataset /
  BlendedDataset over tools/preprocess_data.py's .bin/.idx files), so the tables measure the
  real data path, not a side copy of the tokens.
- When --data-path holds no dataset yet, the two data tools are run as subprocesses, exactly
  as a user would run them (corpus in <data-path>/corpus, .bin/.idx in <data-path>), and the
  commands are returned so the report can print them: one command builds the table from
  nothing.
- Held-out evaluation: `full_eval_iters` gives the number of microbatches that covers the
  smallest domain's whole valid split, so the held-out measure does not depend on the
  per-seed shuffle of Megatron's valid GPTDataset (it holds every sample once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
"""The repository root (megatron_mvmoe/analysis/compare/ is three levels below it)."""
META = "dataset_meta.json"


@dataclass(frozen=True)
class DataRecipe:
    """How the suites' dataset is built when it is missing."""

    max_mb_per_domain: float = 3.0
    """Text cap per domain for tools/build_corpus.py (MB)."""
    vocab_size: int = 4096
    """Trained byte-level BPE vocabulary (tools/preprocess_data.py --vocab-size)."""
    bpe_train_mb: float = 2.0
    """Train-split MB per domain used to train the BPE."""


@dataclass
class DataBuild:
    """What ensure_dataset did: the commands it ran (empty if the data was there)."""

    path: str
    commands: List[str] = field(default_factory=list)
    wall_s: float = 0.0


def build_commands(data_path: str, recipe: DataRecipe) -> List[List[str]]:
    corpus = os.path.join(data_path, "corpus")
    return [
        [sys.executable, os.path.join(ROOT, "tools", "build_corpus.py"), "--out", corpus,
         "--max-mb-per-domain", f"{recipe.max_mb_per_domain:g}"],
        [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--corpus", corpus,
         "--out", data_path, "--tokenizer", "bpe", "--vocab-size", str(recipe.vocab_size),
         "--bpe-train-mb", f"{recipe.bpe_train_mb:g}"],
    ]


def _shown(command: List[str]) -> str:
    """The command as a user types it from the repository root."""
    parts = ["python"] + [os.path.relpath(c, ROOT) if c.startswith(ROOT + os.sep) else c
                          for c in command[1:]]
    return " ".join(parts)


def ensure_dataset(data_path: str, recipe: DataRecipe, log=None) -> DataBuild:
    """Use the indexed dataset at data_path, building it with the data tools if absent."""
    build = DataBuild(path=data_path)
    if os.path.isfile(os.path.join(data_path, META)):
        return build
    if os.path.isdir(data_path) and any(f.endswith(".bin") for f in os.listdir(data_path)):
        raise ValueError(f"--data-path {data_path!r}: has .bin files but no {META}. Fix: "
                         "point at a tools/preprocess_data.py output or an empty/new directory")
    start = time.perf_counter()
    for command in build_commands(data_path, recipe):
        build.commands.append(_shown(command))
        print(f"[compare] data: {build.commands[-1]}", file=log or sys.stderr, flush=True)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
        done = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            raise ValueError(f"data build failed ({build.commands[-1]}):\n"
                             f"{done.stdout[-2000:]}")
    build.wall_s = round(time.perf_counter() - start, 1)
    return build


def full_eval_iters(data_path: str, seq_length: int, micro_batch: int) -> int:
    """Microbatches that cover the smallest domain's valid split once (at least 1)."""
    with open(os.path.join(data_path, META)) as fh:
        prefixes = json.load(fh)["prefixes"]
    valid = [p["tokens"] for name, p in prefixes.items() if name.endswith(".valid")]
    if not valid:
        raise ValueError(f"{data_path}/{META}: no valid splits. Fix: rebuild the dataset")
    samples = (min(valid) - 1) // seq_length  # GPTDataset: one extra token per sample
    return max(1, samples // micro_batch)
