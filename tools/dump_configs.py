#!/usr/bin/env python
"""Dump every configuration the repository ships, resolved, as one JSON document: each model
preset (both registries' names; the seed-2 ones at paper and tiny size), each run config YAML
under examples/ and each compare-suite variant. For each: the loaded run config
(`RunConfig.to_dict()`) and the Megatron TransformerConfig the trainer builds from it
(every field, sorted, repr'd; memory addresses stripped).

Why: a refactor of the configuration code must leave every config unchanged field by field.
Dump before, dump after, diff:

  python tools/dump_configs.py --json /tmp/before.json
  python tools/dump_configs.py --json /tmp/after.json
  diff /tmp/before.json /tmp/after.json && echo identical

Runs on the CPU (the configs of this machine: fp32, the CPU fast paths); builds no model.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import sys
from typing import Any, Dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def megatron_fields(config) -> Dict[str, str]:
    """Every dataclass field of a Megatron config, repr'd without memory addresses."""
    return {f.name: _ADDRESS.sub("", repr(getattr(config, f.name)))
            for f in sorted(dataclasses.fields(config), key=lambda f: f.name)}


def entry(raw: Dict[str, Any]) -> Dict[str, Any]:
    """A run config mapping, loaded and translated as a launch would (or the error)."""
    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.models.build import model_config

    try:
        run = config_from_dict(raw)
        return {"run": json.loads(json.dumps(run.to_dict(), default=repr)),
                "megatron": megatron_fields(model_config(run))}
    except ValueError as err:
        return {"error": str(err)}


def preset_entries() -> Dict[str, Any]:
    from megatron_mvmoe.config import seed2_presets
    from megatron_mvmoe.config.presets import preset_names

    out = {f"preset/{name}": entry({"model": {"preset": name}}) for name in preset_names()}
    for size in seed2_presets.SIZES:
        for name in seed2_presets.family_names():
            fields = seed2_presets.get_preset(name, size=size).model_fields()
            out[f"seed2/{size}/{name}"] = entry({"model": fields})
    return out


def yaml_entries() -> Dict[str, Any]:
    from megatron_mvmoe.config.run_config import read_yaml

    paths = sorted(glob.glob(os.path.join(ROOT, "examples", "**", "*.yaml"), recursive=True))
    return {f"yaml/{os.path.relpath(p, ROOT)}": entry(read_yaml(p)) for p in paths}


def suite_entries() -> Dict[str, Any]:
    from megatron_mvmoe.analysis.compare.suites import SUITES, variants

    return {f"suite/{suite}/{v.name}": entry({"model": dict(v.model)})
            for suite in sorted(SUITES) for v in variants(suite)}


def dump() -> Dict[str, Any]:
    return {**preset_entries(), **yaml_entries(), **suite_entries()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", metavar="PATH", default="-",
                        help="write the dump here (default: standard output)")
    args = parser.parse_args(argv)
    text = json.dumps(dump(), indent=1, sort_keys=True)
    if args.json == "-":
        print(text)
    else:
        with open(args.json, "w") as fh:
            fh.write(text + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
