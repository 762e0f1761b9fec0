"""Shared plumbing of the analysis tools: model specs on the command line, one-rank runs.

A model spec is one of:
  <preset>            a preset of megatron_mvmoe.config.presets, freshly initialised
  <path>.yaml         a run config (fresh init unless the YAML sets training.load)
  <checkpoint dir>    a checkpoint root or iter_* directory (its stored run config)
optionally prefixed by a label: `baseline=tiny_latent`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple


class ToolArgumentParser(argparse.ArgumentParser):
    """argparse for the tools: a wrong argument is one line on stderr and exit status 2,
    never the usage dump (the line names the flag; --help has the rest)."""

    def error(self, message: str):
        fix = "" if "Fix:" in message else ". Fix: see --help"
        self.exit(2, f"error: {message}{fix}\n")


def existing_path(what: str, kind: str = "file"):
    """An argparse `type` that refuses a path that is not an existing `kind` (file or dir),
    so the error names the flag (argparse prefixes it) and what to pass instead."""
    check = os.path.isfile if kind == "file" else os.path.isdir

    def parse(text: str) -> str:
        if not check(text):
            raise argparse.ArgumentTypeError(f"{text!r}: no such {kind}. Fix: pass {what}")
        return text
    return parse


def tool_parser(doc: str) -> ToolArgumentParser:
    """The tools' parser: the whole module docstring as the description (--help)."""
    return ToolArgumentParser(description=doc,
                              formatter_class=argparse.RawDescriptionHelpFormatter)


@dataclass(frozen=True)
class ModelSpec:
    label: str
    preset: Optional[str] = None
    config_path: Optional[str] = None
    checkpoint: Optional[str] = None


def parse_model_spec(text: str) -> ModelSpec:
    label, _, body = text.rpartition("=")
    body = body.strip()
    if not body:
        raise ValueError(f"--model {text!r}: empty. Fix: pass a preset, a .yaml or a checkpoint")
    label = label or os.path.basename(body.rstrip("/")) or body
    if body.endswith((".yaml", ".yml")):
        if not os.path.isfile(body):
            raise ValueError(f"--model {text!r}: file {body!r} not found")
        return ModelSpec(label, config_path=body)
    if os.path.isdir(body):
        return ModelSpec(label, checkpoint=body)
    from megatron_mvmoe.config.presets import PRESETS, preset_names

    if body not in PRESETS:
        raise ValueError(f"--model {text!r}: not a directory, YAML file or preset. Fix: use one "
                         f"of {preset_names()} or a checkpoint directory")
    return ModelSpec(label, preset=body)


def parse_overrides(pairs) -> Dict[str, Any]:
    """`--set section.field=value` pairs -> {"section.field": value} (value parsed as YAML)."""
    import yaml

    out: Dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"--set {pair!r}: expected section.field=value, e.g. "
                             "model.multi_view.gamma_ramp_steps=0")
        out[key.strip()] = yaml.safe_load(value)
    return out


def open_spec(spec: ModelSpec, pg, overrides: Optional[Dict[str, Any]] = None):
    """(OpenModel, run) for a spec on this rank."""
    from megatron_mvmoe.analysis import model_access

    run = model_access.run_config(spec.preset, spec.config_path, spec.checkpoint, overrides)
    return model_access.open_model(run, pg, spec.checkpoint)


def single_rank(fn: Callable, *args, timeout_s: float = 1800.0):
    """Run fn(rank, world_size, *args) on one gloo rank (Megatron needs a process group).

    The rank is NON-daemonic: Megatron's async dist-checkpoint writer starts a
    multiprocessing Manager, which a daemonic process may not do.
    """
    from megatron_mvmoe.launch.local_ranks import run_distributed

    return run_distributed(fn, 1, timeout_s=timeout_s, args=args, daemon=False)[0]


def in_rank_setup():
    """CPU patches + the EP = 1 layout on the already initialised default group."""
    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
    from megatron_mvmoe.platform import apply_cpu_patches

    apply_cpu_patches()
    return initialize_layout(ParallelLayout())


def emit(payload: Dict, as_json: bool, text: str) -> None:
    """Print JSON (machine-readable) or the human summary."""
    if as_json:
        json.dump(payload, sys.stdout, indent=2, default=float)
        sys.stdout.write("\n")
    else:
        print(text)


def fail(message: str) -> Tuple[int, None]:
    print(f"error: {message}", file=sys.stderr)
    return 2, None


def add_heldout_args(parser) -> None:
    """The held-out data, override and output flags every model-reading tool shares."""
    parser.add_argument("--data-path", default=None,
                        help="held-out data dir (overrides the run's data.path); "
                             "none = random tokens")
    parser.add_argument("--data-kind", default=None, choices=["indexed", "tokens"])
    parser.add_argument("--batches", type=int, default=4, help="held-out batches per domain")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="run-config override, e.g. model.multi_view.gamma_ramp_steps=0 (repeatable)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def open_for_rank(spec: ModelSpec, args):
    """Inside a rank: CPU patches + layout, then the model with the tool's data overrides."""
    overrides = {key: value for key, value in (("data.path", args.data_path),
                                               ("data.kind", args.data_kind)) if value}
    overrides.update(parse_overrides(args.set))
    return open_spec(spec, in_rank_setup(), overrides)


def run_per_model(tool: str, args, rank_fn: Callable) -> Tuple[Optional[list], Dict]:
    """Run `rank_fn(rank, world, spec, args)` on one rank per `--model`; returns (results,
    payload with wall time and the command), or (None, {"error": ...}) on a bad spec."""
    import time

    try:
        specs = [parse_model_spec(text) for text in args.model]
    except ValueError as err:
        return None, {"error": str(err)}
    start = time.time()
    results = [single_rank(rank_fn, spec, args) for spec in specs]
    return results, {"results": results, "wall_s": round(time.time() - start, 1),
                     "command": " ".join(["python", tool, *sys.argv[1:]])}


def write_json_atomic(path: str, payload: Dict) -> str:
    """Write JSON via a temporary file and os.replace: a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1, default=str)
    os.replace(tmp, path)
    return path
