"""Downstream scores in the comparison suites: each run's checkpoint evaluated by
tools/lm_eval_run.py on local lm-eval tasks, then per variant mean ± std over seeds of every
task's score and of the macro mean, with the paired per-seed difference of the macro mean to
the reference (95 % t interval, smallest detectable difference), as report.py does for
perplexity. Scores are fractions; the table prints points (x 100), like the paper.

Design choices:
- A run stores {"tasks": {task: score}, "chance": {task: chance}, "mean", "spec"}; the spec
  (tasks, limit) is checked on reuse, so a rerun with another --downstream-limit evaluates
  again instead of mixing item sets.
- Higher is better here (accuracy), the opposite of perplexity: a positive paired Δ favours
  the variant.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Dict, List, Mapping, Optional, Sequence

from megatron_mvmoe.analysis.stats import mean_std, paired_difference

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def spec(tasks: Sequence[str], limit: Optional[int]) -> Dict:
    return {"tasks": list(tasks), "limit": limit}


def evaluate_checkpoint(load: str, tasks: Sequence[str], limit: Optional[int],
                        timeout_s: float = 3600) -> Dict:
    """tools/lm_eval_run.py on one checkpoint (a subprocess: lm-eval builds its own
    one-rank session); the stored form described above."""
    cmd = [sys.executable, os.path.join(REPO, "tools", "lm_eval_run.py"), "--load", load,
           "--tasks", *tasks, "--json"] + (["--limit", str(limit)] if limit else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"lm_eval_run on {load}: {proc.stderr.strip()[-400:]}")
    out = json.loads(proc.stdout[proc.stdout.index("{"):])
    return {"tasks": {t: r["score"] for t, r in out["tasks"].items()},
            "chance": {t: r["chance"] for t, r in out["tasks"].items()},
            "mean": out["mean"], "spec": spec(tasks, limit), "seconds": out["seconds"]}


def _by_seed(runs: Sequence[Mapping]) -> Dict[int, Mapping]:
    return {int(run.get("seed", i + 1)): run for i, run in enumerate(runs)
            if run.get("downstream")}


def _cell(values: List[float]) -> str:
    if not values:
        return "-"
    mean, std = mean_std([100 * v for v in values])
    return f"{mean:.1f} ± {std:.1f}" if len(values) > 1 else f"{mean:.1f}"


def paired_mean_verdict(runs: Sequence[Mapping], ref_runs: Sequence[Mapping]) -> str:
    mine, ref = _by_seed(runs), _by_seed(ref_runs)
    deltas = [100 * (mine[s]["downstream"]["mean"] - ref[s]["downstream"]["mean"])
              for s in sorted(set(mine) & set(ref))]
    if len(deltas) < 2:
        return "paired: < 2 common seeds"
    stats = paired_difference(deltas)
    state = "unresolved" if stats.low <= 0 <= stats.high else "resolved"
    return (f"paired Δ {stats.mean:+.2f} [{stats.low:+.2f}, {stats.high:+.2f}], "
            f"detectable ±{stats.detectable:.2f} ({state})")


def downstream_table(results: Mapping[str, Sequence[Mapping]],
                     references: Mapping[str, str]) -> str:
    """Rows = variants; columns = each task's score, the macro mean, Δ mean vs reference;
    a last row with each task's chance level."""
    scored = {name: [r for r in runs if r.get("downstream")] for name, runs in results.items()}
    scored = {name: runs for name, runs in scored.items() if runs}
    if not scored:
        return "(no run has downstream scores)\n"
    first = next(iter(scored.values()))[0]["downstream"]
    tasks = list(first["tasks"])
    header = ["variant", "seeds", *tasks, "macro mean", "Δ mean vs reference (points)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, runs in scored.items():
        ref = references.get(name, "")
        verdict = ("reference" if not ref else f"vs {ref}: not run" if ref not in scored
                   else f"vs {ref}: " + paired_mean_verdict(runs, scored[ref]))
        cells = [_cell([r["downstream"]["tasks"][t] for r in runs
                        if r["downstream"]["tasks"].get(t) is not None]) for t in tasks]
        lines.append("| " + " | ".join([name, str(len(runs)), *cells,
                                         _cell([r["downstream"]["mean"] for r in runs]),
                                         verdict]) + " |")
    chance = [first["chance"].get(t) for t in tasks]
    lines.append("| chance | | " + " | ".join("-" if c is None else f"{100 * c:.1f}"
                                            for c in chance) + " | | |")
    return "\n".join(lines) + "\n"
