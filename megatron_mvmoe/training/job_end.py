"""How a training launch ended, in one line, printed by the launcher after every traceback:
`python -m megatron_mvmoe.training.job_end --status $status [--save DIR] [--json] [-- ARGS]`.

- This run stopped early on purpose (its own STOPPED_MARKER, same run id): says so and exits
  with EXIT_REQUEUE (3), which the sbatch recipes turn into `scontrol requeue`.
- It failed: which rank or node (from the rank records, training/rank_reports.py: the ranks
  that left no error died or hung; the others only noticed), why, and where to resume (the
  last good checkpoint, with the --load/--ckpt-step that load it); exits 0.
- It finished: prints nothing; exits 0.
A marker of another run (an earlier job, an earlier restart of this one) is stale: it is
named and ignored, so a crash never requeues. The save directory comes from --save, or
from the trainer's own arguments after `--` (their --save, else the YAML's training.save).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional, Sequence

from megatron_mvmoe.training.rank_reports import RankReport, read_reports
from megatron_mvmoe.training.stopping import EXIT_REQUEUE, STOPPED_MARKER, run_id

# checkpointing/directory.py's layout, read here without importing torch (seconds on a
# busy node), so the summary line follows the tracebacks at once.
LATEST, RUN_STATE = "latest", "run_state.json"


def save_from_args(args: Sequence[str]) -> Optional[str]:
    """--save from a trainer command line, else `training.save` of its --config YAML."""
    args = list(args)
    for i, arg in enumerate(args):
        if arg == "--save" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--save="):
            return arg.split("=", 1)[1]
    if "--config" in args and args.index("--config") + 1 < len(args):
        import yaml

        try:
            with open(args[args.index("--config") + 1]) as fh:
                return ((yaml.safe_load(fh) or {}).get("training") or {}).get("save")
        except (OSError, yaml.YAMLError, AttributeError):
            return None
    return None


def _marker(save: Optional[str]) -> Optional[Dict]:
    if save is None:
        return None
    try:
        with open(os.path.join(save, STOPPED_MARKER)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def _last_checkpoint(save: str) -> Optional[str]:
    """The complete checkpoint `latest` names in `save`, else None."""
    try:
        with open(os.path.join(save, LATEST)) as fh:
            directory = os.path.join(save, fh.read().strip())
    except OSError:
        return None
    return directory if os.path.isfile(os.path.join(directory, RUN_STATE)) else None


def _resume_hint(save: Optional[str]) -> str:
    if save is None:
        return "nothing to resume from (no --save)"
    last = _last_checkpoint(save)
    if last is None:
        return f"no checkpoint in {save} to resume from (rerun from the start)"
    step = os.path.basename(last).rsplit("_", 1)[-1]
    return (f"resume from the last good checkpoint {last}: --load {save} "
            f"--ckpt-step {int(step)}" if step.isdigit() else f"resume with --load {last}")


def _ranks(reports: List[RankReport]) -> str:
    ids = [r.rank for r in reports]
    return f"rank {ids[0]}" if len(ids) == 1 else f"ranks {','.join(map(str, ids))}"


def _who_failed(reports: List[RankReport]) -> str:
    """The cause first: silent ranks (grouped into whole nodes where a node went silent),
    then the first rank that raised."""
    silent = [r for r in reports if r.error is None]
    raised = sorted((r for r in reports if r.error is not None), key=lambda r: r.failed_at)
    world = reports[0].world_size
    missing = sorted(set(range(world)) - {r.rank for r in reports})
    parts = []
    for host in sorted({r.host for r in silent}):
        on_host = [r for r in silent if r.host == host]
        whole = all(r.error is None for r in reports if r.host == host)
        pids = ", ".join(str(r.pid) for r in on_host)
        what = (f"node {host} lost ({_ranks(on_host)}, PID {pids}" if whole and
                len({r.host for r in reports}) > 1 else
                f"{_ranks(on_host)} on {host} (PID {pids}")
        parts.append(f"{what}) ended without an error (killed, or hung and killed by the "
                     "launcher)")
    if missing:
        parts.append(f"ranks {missing} never started training")
    if raised:
        first = raised[0]
        others = f" (and {len(raised) - 1} more rank(s) after it)" if len(raised) > 1 else ""
        verb = "then" if parts else "first"
        parts.append(f"{verb} rank {first.rank} on {first.host}: {first.error}{others}")
    return "; ".join(parts)


def verdict(status: int, save: Optional[str], this_run: Optional[str]) -> Dict:
    """{'kind': stopped|failed|finished, 'line': ..., 'requeue': bool}."""
    marker = _marker(save)
    stale = ""
    if marker is not None:
        if this_run is not None and marker.get("run_id") == this_run:
            return {"kind": "stopped", "requeue": True, "line": (
                f"stopped early ({marker.get('reason')}) at step {marker.get('step')} in run "
                f"{this_run}: checkpoint {marker.get('checkpoint')}")}
        stale = (f" (ignored a stale {STOPPED_MARKER} of run {marker.get('run_id')}, not "
                 f"this run {this_run})")
    if status == 0:
        return {"kind": "finished", "requeue": False, "line": stale.strip(" ()")}
    reports = read_reports(save, this_run) if save else []
    who = (_who_failed(reports) if reports else
           "before training started (see the error above)")
    return {"kind": "failed", "requeue": False,
            "line": f"job failed (exit status {status}): {who}; {_resume_hint(save)}{stale}"}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--status", type=int, required=True,
                        help="the launch's exit status (torchrun/srun)")
    parser.add_argument("--save", default=None, help="the run's --save directory")
    parser.add_argument("--json", action="store_true", help="print the verdict as JSON")
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER,
                        help="after --: the trainer's arguments (to find --save)")
    args = parser.parse_args(argv)
    rest = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    save = args.save or save_from_args(rest)
    result = dict(verdict(args.status, save, run_id()), save=save, run_id=run_id())
    if args.json:
        print(json.dumps(result))
    elif result["line"]:
        print(result["line"], flush=True)
    return EXIT_REQUEUE if result["requeue"] else 0


if __name__ == "__main__":
    sys.exit(main())
