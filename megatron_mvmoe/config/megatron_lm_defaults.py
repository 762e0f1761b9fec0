"""Megatron-LM's parser defaults for the run config on a Megatron-LM style line.

A launch line without --config / --model-preset means what it means in Megatron-LM: every
run-config field behind one of Megatron-LM's flags (config/flag_table.py) that the line
leaves out takes the default of Megatron-LM's own parser (megatron_lm_flags.json), so an
optimizer, schedule, precision, timeout, evaluation or logging setting is never this
trainer's silently. Three kinds of field need more than a copy of the default:

- TRANSLATED: Megatron-LM's value spelled in our field's terms (its `None` eval/save
  interval is our 0, "only at the end"; its 10-minute timeout is 600 s; no --bf16 is fp32);
- DERIVED: Megatron-LM computes the value from others (the global batch is micro batch x
  data-parallel size; GQA without --num-query-groups is one group);
- KEPT: Megatron-LM has no usable default (it asserts or fails without the flag) and this
  trainer runs with its own value instead; the start-up notes say so once, with the value.

The model's TransformerConfig fields (`extra.*`) follow megatron_lm_rules._PARSER_DEFAULTS.
Checked field by field against Megatron-LM's own parser, optimizer and DDP configs:
tests/training/test_megatron_lm_defaults_parity.py (record: tools/gen_megatron_lm_parity.py).
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Dict, List, NamedTuple

from megatron_mvmoe.config.flag_table import FLAGS, Flag
from megatron_mvmoe.config.megatron_lm_table import table


class Kept(NamedTuple):
    """A field that keeps this trainer's value on a Megatron-LM style line."""
    flag: str
    why: str


KEPT: Dict[str, Kept] = {
    "optimizer.lr": Kept("--lr", "Megatron-LM has no default learning rate (its scheduler "
                                 "needs --lr)"),
    "training.train_iters": Kept("--train-iters", "Megatron-LM needs --train-iters or "
                                                  "--train-samples"),
    "training.micro_batch_size": Kept("--micro-batch-size", "Megatron-LM asserts that "
                                                            "--micro-batch-size is given"),
}
"""path -> why this trainer's default stands (the note names the value used)."""


def _none_is_zero(value: Any) -> Any:
    return 0 if value is None else value


def _enum_member_name(value: Any) -> Any:
    """'<AttnBackend.auto: 5>' (an enum default as the flags JSON stores it) -> 'auto'."""
    text = str(value)
    return text.split(".", 1)[1].split(":", 1)[0] if text.startswith("<") else value


TRANSLATED: Dict[str, Callable[[Any], Any]] = {
    # Megatron-LM: None = no periodic evaluation (validation once at the end) / no periodic
    # save (at the end only); ours spells both 0.
    "training.eval_interval": _none_is_zero,
    "training.save_interval": _none_is_zero,
    # Megatron-LM's num_query_groups counts only with --group-query-attention (DERIVED);
    # without it every head has its own K/V, which is our None.
    "model.num_query_groups": lambda value: None,
    # None = no per-split paths, our empty lists.
    "data.train_path": lambda value: [] if value is None else value,
    "data.valid_path": lambda value: [] if value is None else value,
    "data.test_path": lambda value: [] if value is None else value,
    # Megatron-LM's AttnBackend enum; ours names its member (auto).
    "model.attention_backend": _enum_member_name,
}
"""path -> Megatron-LM's default in our field's terms."""

DERIVED = ("training.global_batch_size", "model.ffn_hidden_size", "model.moe_ffn_hidden_size",
           "parallel.etp")
"""Computed from other fields as Megatron-LM's validate_args does (global batch here; the
FFN widths and ETP in megatron_lm_rules)."""


def _dest(flag: Flag) -> str:
    return flag.name.lstrip("-").replace("-", "_")


def _defaulted_flags():
    """(path, flag) of every value flag of ours that is a Megatron-LM flag (switches set a
    value only when given, so their absence is the field's Megatron-LM meaning already)."""
    for flag in FLAGS:
        if flag.const is None and not flag.field.startswith("extra.") and \
                flag.name in table():
            yield f"{flag.section}.{flag.field}", flag


def parser_defaults(args: argparse.Namespace) -> Dict[str, Any]:
    """path -> Megatron-LM's value for every field whose flag the line leaves out."""
    values: Dict[str, Any] = {}
    for path, flag in _defaulted_flags():
        if getattr(args, _dest(flag)) is not None or path in KEPT or path in DERIVED:
            continue
        default = table()[flag.name].default
        if path in TRANSLATED:
            values[path] = TRANSLATED[path](default)
        elif default is not None:
            values[path] = default
    if args.bf16 is None and args.precision is None:
        values["training.precision"] = "fp32"  # Megatron-LM trains fp32 without --bf16
    timeout = getattr(args, "conv_distributed_timeout_minutes", None)
    if timeout is None:
        values["parallel.distributed_timeout_seconds"] = \
            60.0 * table()["--distributed-timeout-minutes"].default
    if getattr(args, "accumulate_allreduce_grads_in_fp32", None) is None:
        # validate_args: with --bf16 (and its --main-grads-dtype default fp32; a
        # --grad-reduce-in-bf16 is refused here) gradients accumulate and reduce in fp32
        values["optimizer.grad_reduce_in_fp32"] = bool(args.bf16) or \
            table()["--accumulate-allreduce-grads-in-fp32"].default
    return values


def apply(raw: Dict[str, Any], args: argparse.Namespace) -> None:
    """Megatron-LM's defaults into `raw` (in place) where nothing set the field yet, then
    the derived global batch."""
    for path, value in parser_defaults(args).items():
        section, name = path.split(".")
        raw.setdefault(section, {}).setdefault(name, value)
    _global_batch(raw)
    if args.compat_group_query_attention and args.num_query_groups is None:
        raw["model"]["num_query_groups"] = table()["--num-query-groups"].default


def _global_batch(raw: Dict[str, Any]) -> None:
    """Megatron-LM's validate_args: no --global-batch-size = micro batch x data-parallel
    size, from the launcher's WORLD_SIZE (1 for a single process)."""
    from megatron_mvmoe.config.run_config import TrainingSection

    training, parallel = raw.setdefault("training", {}), raw.get("parallel") or {}
    if training.get("global_batch_size") is not None:
        return
    model_parallel = 1
    for name in ("tp", "pp", "cp"):
        model_parallel *= int(parallel.get(name) or 1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro = int(training.get("micro_batch_size", TrainingSection.micro_batch_size))
    training["global_batch_size"] = micro * max(world // model_parallel, 1)


def notes(args: argparse.Namespace) -> List[str]:
    """One start-up line per field that keeps this trainer's value on a Megatron-LM style
    line (an empty list when the line gives those flags)."""
    from megatron_mvmoe.config.run_config import RunConfig

    defaults = RunConfig()
    lines = []
    for path, (flag, why) in KEPT.items():
        if getattr(args, flag.lstrip("-").replace("-", "_")) is None:
            section, name = path.split(".")
            value = getattr(getattr(defaults, section), name)
            lines.append(f"{flag} not given: {why}; this run uses {value}")
    return lines

