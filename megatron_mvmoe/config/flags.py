"""Megatron-style command-line flags that override single RunConfig fields.

Design choices:
- One table (config/flag_table.py) maps each flag to (section, field, type); the argparse
  parser and the override step here are both generated from it, so a flag cannot exist
  without a field.
- A flag's help IS its field's docstring (config/field_docs.py), so the table keeps only
  what the docstrings cannot say: Megatron-LM's names, the notes of flags that set
  Megatron TransformerConfig fields we pass through (`extra.<name>`) or of switches that
  set a value (`--bf16`), and flag-only rules. Accepted and refused Megatron-LM flags are
  megatron_flags.py's and megatron_lm_table.py's.
- Flag names follow Megatron-LM's (`--tensor-model-parallel-size`, `--train-iters`, ...)
  with Megatron-LM's meaning, so launch scripts port over; an unset flag (None) leaves the
  YAML/preset value alone. Megatron-LM switches that describe what we always do, and flags
  we refuse with a reason, live in megatron_flags.py.
- Megatron-LM rules kept: `--ffn-hidden-size` also sets the expert width when
  `--moe-ffn-hidden-size` is not given; `--num-experts` without a preset or variant means
  a routed-expert MoE (smoe); the vocabulary is the tokenizer's, padded
  (`--make-vocab-size-divisible-by`); `--vocab-size` with NullTokenizer is its id count.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from megatron_mvmoe.config import (megatron_flags, megatron_lm_defaults, megatron_lm_rules,
                                   megatron_lm_table)
from megatron_mvmoe.config.field_docs import doc_of
from megatron_mvmoe.config.flag_table import FLAGS, Flag, parse_bool, parse_moe_freq
from megatron_mvmoe.config.presets import PRESETS
from megatron_mvmoe.config.run_config import (RunConfig, config_from_dict, read_yaml, set_field,
                                              unset_field)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one-line ValueErrors (exit 2 with one line in pretrain's
    main), never a usage dump."""

    def error(self, message: str):
        raise ValueError(f"{message}. Fix: see --help")


def build_parser(description: str = "megatron_mvmoe pretraining") -> argparse.ArgumentParser:
    parser = _Parser(
        description=description, allow_abbrev=False,  # a Megatron flag must not prefix-match ours
        epilog="Every flag overrides one field of the run config (shown as [section.field]); "
        "unset flags keep the YAML / preset value, an empty string clears an optional field. "
        "Megatron-LM switches that describe what this trainer always does are accepted and "
        f"noted at start-up: {' '.join(sorted(megatron_flags.ACCEPTED))}. Every other flag "
        "of Megatron-LM's arguments.py is known too (megatron_mvmoe/config/"
        "megatron_lm_flags.json): accepted with a note, or refused with the reason and what "
        "to use instead (megatron_lm_table.py); all refusals of a line are reported at once.")
    parser.add_argument("--config", help="run config YAML (examples/*.yaml); flags override it")
    parser.add_argument("--unset", action="append", default=[], metavar="SECTION.FIELD",
                        help="drop a field the YAML or the preset sets, as if never given "
                        "(its default; None = derived, e.g. --unset model.vocab_size takes "
                        "the tokenizer's vocabulary); repeatable")
    for flag in FLAGS:
        parser.add_argument(flag.name, *megatron_lm_table.other_spellings(flag.name),
                            default=None, help=flag_help(flag), **_argument_kind(flag))
    group = parser.add_argument_group("Megatron-LM flags accepted as already true here")
    for name, rule in megatron_flags.ACCEPTED.items():
        takes_value = rule.values is not None or rule.any_value
        group.add_argument(name, *megatron_lm_table.other_spellings(name),
                           dest=_compat_dest(name), default=None,
                           help=rule.note or "accepted",
                           **({"metavar": "VALUE"} if takes_value else
                              {"action": "store_const", "const": True}))
    megatron_lm_rules.add_converted_flags(parser)
    taken = {a for action in parser._actions for a in action.option_strings}
    megatron_lm_table.add_table_flags(parser, taken)
    return parser


def flag_help(flag: Flag) -> str:
    """The field's docstring, then the flag's note, then where it lands ([section.field])."""
    doc = doc_of(RunConfig, f"{flag.section}.{flag.field}") if flag.const is None else None
    parts = [part for part in (doc, flag.note) if part]
    if flag.type is parse_bool:
        parts.append("true/false; a bare flag = true")
    text = "; ".join(part.rstrip(".") for part in parts[:-1]) + ("; " if parts[1:] else "")
    return (text + (parts[-1] if parts else "")).replace("%", "%%") + \
        f" [{flag.section}.{flag.field}]"


def _compat_dest(name: str) -> str:
    return "compat_" + name.lstrip("-").replace("-", "_")


def _argument_kind(flag: Flag) -> dict:
    if flag.const is not None:
        return {"action": "store_const", "const": flag.const,
                "dest": _dest(flag)}
    # Booleans also work as bare switches (`--bitnet` = `--bitnet true`).
    switch = dict(nargs="?", const=True) if flag.type is parse_bool else {}
    if flag.nargs:
        switch["nargs"] = flag.nargs
    return dict(type=flag.type, metavar=_metavar(flag), dest=_dest(flag), **switch)


def _dest(flag: Flag) -> str:
    return flag.name.lstrip("-").replace("-", "_")


def _metavar(flag: Flag) -> str:
    return {int: "N", float: "X", parse_bool: "BOOL", parse_moe_freq: "N|LIST"}.get(flag.type, "STR")


def _apply(raw: Dict[str, Any], args: argparse.Namespace) -> List[str]:
    for flag in FLAGS:
        value = getattr(args, _dest(flag))
        if value is not None:
            set_field(raw, f"{flag.section}.{flag.field}", None if value == "" else value)
    _megatron_rules(raw, args)
    return megatron_lm_rules.apply_conversions(raw, args) + \
        megatron_lm_rules.apply_megatron_lm_defaults(raw, args) + megatron_lm_rules.backend_problems(raw)


def _megatron_rules(raw: Dict[str, Any], args: argparse.Namespace) -> None:
    """Megatron-LM semantics that span fields (see the module docstring)."""
    model, data = raw.get("model") or {}, raw.get("data") or {}
    preset = PRESETS.get(model.get("preset"), {})
    if args.ffn_hidden_size is not None and args.moe_ffn_hidden_size is None \
            and model.get("moe_ffn_hidden_size", preset.get("moe_ffn_hidden_size")) is None:
        model["moe_ffn_hidden_size"] = args.ffn_hidden_size
    path = data.get("path")
    if isinstance(path, list) and len(path) == 1 and os.path.isdir(path[0]):
        data["path"] = path[0]  # our preprocessed directory, not a Megatron prefix
    if args.tensorboard_dir:
        raw.setdefault("logging", {})["tensorboard"] = True


def _table_given(args: argparse.Namespace):
    """(name, value) of the other Megatron-LM flags on the command line (once per flag, under
    its first spelling: two spellings share one argparse dest)."""
    seen = set()
    for name in megatron_lm_table.table():
        key = megatron_lm_table.dest(name)
        value = getattr(args, key, None)
        if value is not None and key not in seen:
            seen.add(key)
            yield name, value


def compat_notes(args: argparse.Namespace) -> List[str]:
    """Notes for the accepted-as-is Megatron-LM flags given on the command line."""
    given = megatron_flags.notes(name for name in megatron_flags.ACCEPTED
                                 if getattr(args, _compat_dest(name)) is not None)
    if megatron_lm_rules.megatron_lm_style(args):
        given += megatron_lm_defaults.notes(args)
    return given + [v.note for v in (megatron_lm_table.classify(n, x) for n, x in
                                     _table_given(args)) if v.note]


def refusal_error(problems: List[str]) -> ValueError:
    """One error for all of a launch line's refusals (one line each)."""
    if len(problems) == 1:
        return ValueError(problems[0])
    return ValueError(f"{len(problems)} flags refused:\n  " + "\n  ".join(problems))


def flag_problems(args: argparse.Namespace, unknown: List[str],
                  known: Sequence[str]) -> List[str]:
    """Every refusal of a parsed launch line (unknown, unsupported, unsupported values)."""
    problems = megatron_flags.unknown_flag_lines(unknown, known) if unknown else []
    for name in megatron_flags.ACCEPTED:
        value = getattr(args, _compat_dest(name))
        if value is not None:
            try:
                megatron_flags.check_accepted(name, value)
            except ValueError as err:
                problems.append(str(err))
    for name, value in _table_given(args):
        if name in megatron_flags.UNSUPPORTED:
            why, instead = megatron_flags.UNSUPPORTED[name]
            problems.append(f"{name}: not supported: {why}. Use instead: {instead}")
            continue
        verdict = megatron_lm_table.classify(name, value)
        if verdict.refusal:
            problems.append(verdict.refusal)
    return problems


def parse_args(argv: Optional[Sequence[str]] = None,
               parser: Optional[argparse.ArgumentParser] = None) -> argparse.Namespace:
    """argparse, with every unknown or unsupported flag of the line in one ValueError."""
    args, problems = _parse(argv, parser)
    if problems:
        raise refusal_error(problems)
    return args


def _parse(argv, parser) -> tuple:
    parser = parser or build_parser()
    args, unknown = parser.parse_known_args(argv)
    known = [a for action in parser._actions for a in action.option_strings]
    return args, flag_problems(args, unknown, known)


def _unset_conflicts(args: argparse.Namespace) -> List[str]:
    """--unset of a field that a flag of the same line sets."""
    return [f"--unset {path}: {flag.name} sets it on the same line. Fix: keep one of them"
            for path in args.unset for flag in FLAGS
            if f"{flag.section}.{flag.field}" == path and getattr(args, _dest(flag)) is not None]


def config_from_args(argv: Optional[Sequence[str]] = None,
                     parser: Optional[argparse.ArgumentParser] = None) -> RunConfig:
    """YAML (if --config) then flag overrides, validated field by field."""
    args, problems = _parse(argv, parser)
    raw = read_yaml(args.config) if args.config else {}
    problems += _apply(raw, args) + _unset_conflicts(args)  # every refusal in one error
    if problems:
        raise refusal_error(problems)
    config = config_from_dict(raw)
    for path in args.unset:
        unset_field(config, path)
    config.validate()
    if os.environ.get("RANK", "0") == "0":
        for note in compat_notes(args):
            print(f"note: {note}", file=sys.stderr, flush=True)
    return config
