"""Generate config/megatron_lm_flags.json: every flag of Megatron-LM's
`megatron/training/arguments.py` (the copy shipped with the pinned megatron-core wheel, which
is byte-identical to NVIDIA/Megatron-LM branch core_r0.19.0 at
f8837c04ef6cbef6cdefb8de001aad63178aebbf) with whether it takes a value and its default.

Why two sources: the explicit `add_argument` calls are read with `ast` (no import), but
about half of Megatron-LM's flags are generated from dataclasses by its
`ArgumentGroupFactory` (TransformerConfig, TrainingConfig, ...), which only exist once that
code runs; those come from Megatron-LM's own `add_megatron_arguments` on a fresh parser.
The test (tests/config/test_megatron_lm_flags.py) checks the table against both.

Usage: .venv/bin/python tools/gen_megatron_lm_flags.py [--check] [--json]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

TABLE = os.path.join(os.path.dirname(__file__), "..", "megatron_mvmoe", "config",
                     "megatron_lm_flags.json")


def arguments_file() -> str:
    """Megatron-LM's arguments.py as installed beside megatron.core (not imported)."""
    import importlib.util
    spec = importlib.util.find_spec("megatron.core")
    path = os.path.join(os.path.dirname(os.path.dirname(spec.origin)), "training",
                        "arguments.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    return path


def ast_flags(path: str) -> dict:
    """{flag: takes_value} for every explicit `*.add_argument('--x', ...)` call."""
    flags = {}
    for node in ast.walk(ast.parse(open(path).read())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        names = [a.value for a in node.args if isinstance(a, ast.Constant)
                 and isinstance(a.value, str) and a.value.startswith("--")]
        action = next((k.value for k in node.keywords if k.arg == "action"), None)
        action = (action.value if isinstance(action, ast.Constant) else
                  action.attr if isinstance(action, ast.Attribute) else None)
        if action == "BooleanOptionalAction":  # --x and --no-x, both bare switches
            names += ["--no-" + n[2:] for n in names]
        nargs = next((k.value for k in node.keywords if k.arg == "nargs"), None)
        nargs = nargs.value if isinstance(nargs, ast.Constant) else None
        takes = action not in ("store_true", "store_false", "store_const", "count",
                               "BooleanOptionalAction") \
            and nargs != 0
        for name in names:
            flags[name] = takes
    return flags


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return repr(value)


def parser_flags() -> dict:
    """{flag: row} from Megatron-LM's own parser construction."""
    from megatron.training.arguments import add_megatron_arguments
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    group_of = {id(a): g.title for g in parser._action_groups for a in g._group_actions}
    rows = {}
    for action in parser._actions:
        for name in action.option_strings:
            if not name.startswith("--") or name == "--help":
                continue
            rows[name] = {"dest": action.dest, "takes_value": action.nargs != 0,
                          "nargs": action.nargs, "default": _jsonable(action.default),
                          "choices": _jsonable(list(action.choices)) if action.choices
                          else None, "group": group_of.get(id(action))}
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the checked-in table differs from the file")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    args = parser.parse_args(argv)
    path = arguments_file()
    rows = parser_flags()
    explicit = ast_flags(path)
    for name in sorted(set(explicit) - set(rows)):
        # Added only when an optional package is importable (e.g. --kitchen-* with
        # nvidia-kitchen): known all the same.
        rows[name] = {"dest": name[2:].replace("-", "_"), "takes_value": explicit[name],
                      "nargs": None, "default": None, "choices": None,
                      "group": "conditional (optional package)"}
    from importlib.metadata import version  # megatron.core's __version__ has a git suffix
    table = {"source": "megatron/training/arguments.py of megatron-core "
             f"{version('megatron-core')} (= NVIDIA/Megatron-LM core_r0.19.0 "
             "f8837c04ef6cbef6cdefb8de001aad63178aebbf)",
             "flags": dict(sorted(rows.items()))}
    text = json.dumps(table, indent=1, sort_keys=False) + "\n"
    if args.check:
        same = open(TABLE).read() == text
        print(json.dumps({"same": same}) if args.json else
              ("table up to date" if same else "table differs: rerun without --check"))
        return 0 if same else 1
    with open(TABLE, "w") as fh:
        fh.write(text)
    summary = {"flags": len(rows), "explicit_add_argument": len(explicit),
               "table": os.path.relpath(TABLE)}
    print(json.dumps(summary) if args.json else
          f"{len(rows)} flags ({summary['explicit_add_argument']} explicit) -> {TABLE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
