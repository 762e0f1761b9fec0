"""`--model` specs of the analysis tools, opened on one gloo rank.

A model spec is one of:
  <preset>            a preset of megatron_mvmoe.config.presets, freshly initialised
  <path>.yaml         a run config (fresh init unless the YAML sets training.load)
  <checkpoint dir>    a checkpoint root or iter_* directory (its stored run config)
optionally prefixed by a label: `baseline=tiny_latent`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

from megatron_mvmoe.toolkit.checkpoint import OpenModel, open_model, run_config
from megatron_mvmoe.toolkit.flags import heldout_overrides


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


def open_spec(spec: ModelSpec, pg, overrides: Optional[Dict[str, Any]] = None) -> OpenModel:
    """The spec's model on this rank."""
    run = run_config(spec.preset, spec.config_path, spec.checkpoint, overrides)
    return open_model(run, pg, spec.checkpoint)


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


def open_for_rank(spec: ModelSpec, args) -> OpenModel:
    """Inside a rank: CPU patches + layout, then the model with the tool's data overrides."""
    return open_spec(spec, in_rank_setup(), heldout_overrides(args))


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
