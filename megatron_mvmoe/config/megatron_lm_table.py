"""Every Megatron-LM flag (megatron_lm_flags.json, generated from Megatron-LM's
arguments.py by tools/gen_megatron_lm_flags.py) gets one classification here:

- implemented: a flag_table.FLAGS entry with Megatron-LM's meaning;
- accepted: parsed, and a `note:` line at start-up says what it means here
  (megatron_flags.ACCEPTED, or `NOTED` below, or its group's note in `GROUP_NOTES`);
- refused: `not supported: why. Use instead: ...` (megatron_flags.UNSUPPORTED, or its group's
  reason in `GROUP_REFUSALS`). A refused flag given with Megatron-LM's own default value
  changes nothing, so it is accepted with a note saying so (and nothing more: it may belong
  to a feature that does not run here).

Why group rules: Megatron-LM has ~850 flags; whole groups (inference, RL, vision, logging
back-ends, profiling, ...) share one reason. Flags that a real MoE launch script passes get
their own line in `NOTED` / megatron_flags.UNSUPPORTED.
"""

from __future__ import annotations

import argparse
import json
import os
from functools import lru_cache
from typing import Any, Dict, NamedTuple, Optional

TABLE_PATH = os.path.join(os.path.dirname(__file__), "megatron_lm_flags.json")


class Row(NamedTuple):
    name: str
    dest: str
    takes_value: bool
    nargs: Any
    default: Any
    group: str


@lru_cache(maxsize=1)
def table() -> Dict[str, Row]:
    """{flag: Row} of Megatron-LM's parser (read once; a pure function of the file)."""
    with open(TABLE_PATH) as fh:
        flags = json.load(fh)["flags"]
    return {name: Row(name, r["dest"], r["takes_value"], r["nargs"], r["default"],
                      r["group"] or "") for name, r in flags.items()}


# Accepted with what they mean here (performance / bookkeeping switches of real MoE scripts).
NOTED: Dict[str, str] = {
    "--manual-gc": "Python's garbage collector runs as usual (a speed hint only)",
    "--manual-gc-interval": "Python's garbage collector runs as usual (a speed hint only)",
    "--no-mmap-bin-files": "the .bin files are memory-mapped (Megatron's IndexedDataset "
                           "default); that changes only how they are read, not the data",
    "--log-params-norm": "the parameter norm is not logged; the grad norm is, every step",
    "--log-num-zeros-in-grad": "zeros in the gradient are not counted",
    "--auto-detect-ckpt-format": "checkpoints are always torch_dist, which is what is read",
    "--dist-ckpt-strictness": "loading is strict: a missing or unexpected key fails the load "
                              "with the key named",
    "--deterministic-mode": "not acted on: it sets NCCL/cuBLAS determinism; CPU/gloo runs "
                            "repeat bit for bit already (tests/training/test_golden_losses.py)",
    "--no-bias-gelu-fusion": "GeLU is never fused here; SwiGLU's fusion follows the "
                            "platform (models/fast_paths.py)",
    "--use-persistent-ckpt-worker": "async saves use Megatron's own background writer",
    "--ckpt-fully-parallel-load": "dist-checkpointing chooses the load strategy",
    "--ckpt-fully-parallel-save": "dist-checkpointing chooses the save strategy",
    "--no-ckpt-fully-parallel-save": "dist-checkpointing chooses the save strategy",
    "--ckpt-assume-constant-structure": "a speed hint for repeated saves; not acted on",
    "--use-pytorch-profiler": "no profiler is wired; the progress line has the step time",
    "--profile": "no profiler is wired; the progress line has the step time",
    "--log-timers-to-tensorboard": "timers are not logged separately",
    "--log-loss-scale-to-tensorboard": "there is no loss scale (bf16/fp32 only)",
    "--log-world-size-to-tensorboard": "the world size is in run_info.json",
    "--cross-entropy-loss-fusion": "the loss is Megatron's vocab-parallel cross entropy",
    "--cross-entropy-fusion-impl": "the loss is Megatron's vocab-parallel cross entropy",
    "--no-create-attention-mask-in-dataloader": "the causal mask is built by the model",
    "--exit-on-missing-checkpoint": "a missing --load checkpoint starts fresh only when "
                                    "--load = --save (a fresh job); otherwise it fails",
    "--num-dataset-builder-threads": "Megatron's dataset builder runs in the training "
                                     "process",
}

# Refused with their own reason (unless given with Megatron-LM's default).
REFUSED: Dict[str, tuple] = {
    "--use-rope-scaling": ("RoPE scaling (Llama-3 style) is not wired",
                           "drop the flag (plain RoPE with --rotary-base)"),
}

_NO_EFFECT = "Megatron-LM {group} option: no effect on training here"
# Groups whose flags do not change the model, the data or the update.
GROUP_NOTES: Dict[str, str] = {
    g: _NO_EFFECT for g in (
        "logging", "profiling", "one logger", "straggler", "ft_package", "In-process restart",
        "workload inspector", "msc", "rerun engine", "autoresume")}

# Groups of features this trainer does not have.
GROUP_REFUSALS: Dict[str, tuple] = {
    "inference": ("inference serving is not part of pretraining here",
                  "tools/generate.py for sampling"),
    "rl": ("reinforcement learning is not implemented", "drop the flag"),
    "vision": ("vision models are not implemented (GPT text models only)", "drop the flag"),
    "biencoder": ("biencoder/retrieval models are not implemented", "drop the flag"),
    "Logits Distillation": ("distillation is not implemented", "drop the flag"),
    "sft": ("SFT datasets are not wired (pretraining data only)", "drop the flag"),
    "mla": ("MLA latent caching serves Megatron's inference backend and the fused down "
            "projection needs TransformerEngine", "drop the flag (--multi-latent-attention "
                                                  "runs without it)"),
    "experimental_attention_variant": ("attention variants are not wired", "drop the flag"),
    "heterogeneous architecture": ("heterogeneous layer configs are not implemented",
                                   "one layer shape (--num-layers, --hidden-size, ...)"),
    "fault injector": ("fault injection is not wired",
                       "tests/training/test_fault_tolerance.py's kill/NaN injection"),
    "Transformer-Engine": ("FP8/FP4 needs TransformerEngine, which this build does not use",
                           "--bf16"),
    "conditional (optional package)": ("needs an optional NVIDIA package", "drop the flag"),
}
_GENERIC = ("this trainer implements Megatron-LM's default for it, not other values",
            "drop the flag (Megatron-LM's default {default!r} applies)")


class Verdict(NamedTuple):
    note: Optional[str]
    """Accepted: the note line (None when refused)."""
    refusal: Optional[str]
    """Refused: 'not supported: why. Use instead: ...' (None when accepted)."""


def _is_default(row: Row, value: Any) -> bool:
    if not row.takes_value:
        return False  # a bare switch always changes something
    if isinstance(value, list) and not isinstance(row.default, list):
        return False
    if isinstance(row.default, (int, float)) and not isinstance(row.default, bool):
        try:
            return float(value) == float(row.default)
        except (TypeError, ValueError):
            return False
    return str(value) == str(row.default)


def classify(name: str, value: Any) -> Verdict:
    """The verdict for a Megatron-LM flag that flags.FLAGS / megatron_flags.ACCEPTED /
    megatron_flags.UNSUPPORTED do not cover, given with `value` (True for a bare switch)."""
    row = table()[name]
    if NOTED.get(name):
        return Verdict(f"{name}: {NOTED[name]}", None)
    if row.group in GROUP_NOTES:
        return Verdict(f"{name}: {GROUP_NOTES[row.group].format(group=row.group)}", None)
    if _is_default(row, value):
        # Only what is true of every such flag: the line means the same without it (it may
        # belong to a feature that does not run here, e.g. --muon-momentum under Adam).
        return Verdict(f"{name} {value}: Megatron-LM's default value; the line means the "
                       "same without it", None)
    why, instead = REFUSED.get(name) or GROUP_REFUSALS.get(row.group, _GENERIC)
    return Verdict(None, f"{name}: not supported: {why}. Use instead: "
                         f"{instead.format(default=row.default)}")


def other_spellings(name: str) -> list:
    """Megatron-LM's other spellings of flag `name`: its argparse takes, e.g.,
    --override-opt_param-scheduler for --override-opt-param-scheduler (same dest, '_' for
    '-'); they are registered on the same argparse action as `name`."""
    row = table().get(name)
    if row is None:
        return []
    return [other for other, r in table().items() if other != name and r.dest == row.dest
            and other.replace("_", "-") == name.replace("_", "-")]


def dest(name: str) -> str:
    """argparse dest of a table flag registered by `add_table_flags`."""
    return "mlm_" + name.lstrip("-").replace("-", "_")


def add_table_flags(parser, taken) -> list:
    """Register every Megatron-LM flag not in `taken` (the names already on `parser`), with
    Megatron-LM's arity, so a launch line parses as Megatron-LM parses it and each such flag
    can be classified. Returns the names registered."""
    group = parser.add_argument_group(
        "Other Megatron-LM flags (accepted with a note, or refused with the reason)")
    added = []
    for name, row in table().items():
        if name in taken or any(other in taken for other in other_spellings(name)):
            continue
        kind = ({"nargs": row.nargs, "metavar": "VALUE"} if row.takes_value else
                {"action": "store_const", "const": True})
        # Not listed one by one in --help (the epilog points here): ~700 of them.
        group.add_argument(name, dest=dest(name), default=None, help=argparse.SUPPRESS,
                           **kind)
        added.append(name)
    return added
