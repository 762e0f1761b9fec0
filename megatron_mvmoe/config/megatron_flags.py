"""Megatron-LM flags that are not one-to-one run-config fields: what this trainer accepts as
already true, what it checks, and what it refuses with the reason and the alternative.

Design choices:
- `ACCEPTED`: switches and values in Megatron-LM launch scripts that describe what this
  trainer always does (Megatron-Core models, GQA by --num-query-groups, ...) or performance
  hints it does not act on (the architecture switches --swiglu, --normalization, ... are
  model fields: config/flag_table.py). They are parsed, checked against the values we
  implement, and a note per flag is printed at start-up, so a
  Megatron-LM script runs unchanged and the user sees what each such flag meant here.
- `UNSUPPORTED`: flags we know and do not implement; each gives "not supported: why.
  Use instead: ...". A flag in neither table, nor in flags.FLAGS, gets the closest known
  names. Both are ValueErrors (exit 2 with one line), never an argparse usage dump.
"""

from __future__ import annotations

import difflib
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple


class Accepted(NamedTuple):
    note: str
    values: Optional[Tuple[str, ...]] = None
    """Allowed values when the flag takes one (None = a bare switch)."""
    any_value: bool = False
    """The flag takes a value and any value is fine (e.g. --num-workers)."""


ACCEPTED: Dict[str, Accepted] = {
    "--verify-integrity": Accepted(
        "every checkpoint here carries a SHA-256 manifest of all its files, checked on every "
        "load (checkpointing/integrity.py; tests/training/test_fault_tolerance.py::"
        "test_damaged_checkpoint_is_one_line_naming_file_and_fix)"),
    "--async-strategy": Accepted(
        "async saves use Megatron-Core's own writer, 'mcore' ('nvrx' needs "
        "nvidia-resiliency-ext, not installed)", ("mcore",)),
    "--async-ckpt-use-cpu-shm": Accepted(
        "a staging option of Megatron-LM's default async writer 'nvrx'; async saves here use "
        "Megatron-Core's 'mcore' writer, which stages in its own process: the files are the "
        "same"),
    "--use-mcore-models": Accepted("models are always Megatron-Core GPTModel"),
    "--group-query-attention": Accepted("GQA follows --num-query-groups"),
    "--no-position-embedding": Accepted(
        "Megatron-Core's GPTModel ignores it: position embeddings follow "
        "--position-embedding-type"),
    "--sequence-parallel": Accepted("sequence parallelism is on whenever TP > 1 (with TP = 1 "
                                    "Megatron-LM turns it off too)"),
    "--moe-grouped-gemm": Accepted("the platform picks it (models/fast_paths.py): "
                                   "TEGroupedMLP on a GPU with TransformerEngine, "
                                   "SequentialMLP elsewhere"),
    "--overlap-grad-reduce": Accepted("the platform picks it (models/fast_paths.py): on "
                                      "with NCCL, off with gloo (nothing to overlap with)"),
    "--overlap-param-gather": Accepted("the platform picks it (models/fast_paths.py): on "
                                       "with NCCL, off with gloo"),
    "--no-persist-layer-norm": Accepted(
        "apex's persistent LayerNorm kernel is off in every run here, as the flag asks "
        "(models/provider.py)"),
    "--no-load-rng": Accepted("RNG states are restored only together with the optimizer "
                              "state; with --no-load-optim they are not"),
    "--log-throughput": Accepted("tokens/s is always in the progress line"),
    "--log-timers-to-tensorboard": Accepted("timers are not logged separately"),
    "--log-validation-ppl-to-tensorboard": Accepted("eval loss and ppl per component are "
                                                    "always logged"),
    "--log-memory-to-tensorboard": Accepted("peak memory is always logged"),
    "--use-flash-attn": Accepted("the platform picks it (models/fast_paths.py): TE "
                                 "attention on a GPU with TransformerEngine, torch SDPA "
                                 "elsewhere (--attention-backend)"),
    "--transformer-impl": Accepted("the platform picks the spec (models/fast_paths.py): "
                                   "TE on a GPU with TransformerEngine, local elsewhere",
                                   ("local", "transformer_engine")),
    "--distributed-backend": Accepted("the platform picks NCCL on GPU, gloo on CPU",
                                      ("nccl", "gloo")),
    "--num-workers": Accepted("samples are read in the training process", any_value=True),
    "--timing-log-level": Accepted("no timers beyond the progress line", any_value=True),
}

UNSUPPORTED: Dict[str, Tuple[str, str]] = {
    "--fp8-format": ("FP8 needs TransformerEngine, which this build does not use",
                     "--bf16"),
    "--num-layers-per-virtual-pipeline-stage": (
        "virtual stages are given by count here", "--virtual-pipeline-model-parallel-size N"),
    "--per-split-data-args-path": ("data arguments come from flags here",
                                   "--train-data-path/--valid-data-path/--test-data-path"),
    "--data-args-path": ("data arguments come from flags here", "--data-path"),
    "--dataloader-type": ("samples always follow Megatron's pretraining sampler order "
                          "('single')", "drop the flag"),
    "--use-torch-fsdp2": ("torch FSDP2 is not wired (Megatron-FSDP is)",
                          "--use-megatron-fsdp"),
    "--tp-comm-overlap": ("needs TransformerEngine userbuffers", "drop the flag"),
    "--squared-relu": ("MLPs are SwiGLU or GeLU", "drop the flag (GeLU) or --swiglu"),
    "--apply-layernorm-1p": ("norms are plain RMSNorm or LayerNorm", "drop the flag"),
    "--vocab-extra-ids": ("extra ids are not added to tokenizers here", "drop the flag"),
    "--legacy-tokenizer": ("tokenizers are built from local files by this package",
                           "--tokenizer-type with --vocab-file/--merge-file/--tokenizer-model"),
}


def check_accepted(name: str, value) -> None:
    """Refuse a value we do not implement (e.g. --normalization LayerNorm)."""
    rule = ACCEPTED[name]
    if rule.values is not None and str(value) not in rule.values:
        raise ValueError(f"{name} {value}: not supported: {rule.note}. Use instead: "
                         f"{name} {rule.values[0]} (or drop the flag)")


def notes(given: Iterable[str]) -> List[str]:
    """One line per accepted-as-is flag the user gave."""
    return [f"{name}: {ACCEPTED[name].note}" for name in given if ACCEPTED[name].note]


def unknown_flag_lines(tokens: List[str], known: Iterable[str]) -> List[str]:
    """One refusal line per command-line token argparse did not recognise."""
    flags = [t.split("=")[0] for t in tokens if t.startswith("--")]
    if not flags:
        return [f"unexpected arguments {tokens}. Fix: every value follows its flag"]
    lines = []
    for name in flags:
        if name in UNSUPPORTED:
            why, instead = UNSUPPORTED[name]
            lines.append(f"{name}: not supported: {why}. Use instead: {instead}")
            continue
        close = difflib.get_close_matches(name, list(known) + list(UNSUPPORTED), n=3,
                                          cutoff=0.8)
        hint = f"did you mean {', '.join(close)}?" if close else "see --help for every flag"
        lines.append(f"{name}: unknown flag (neither ours nor one of Megatron-LM's "
                     f"arguments.py). Fix: {hint}")
    return lines

