"""The planner against a run: measured (memory/rank<R>.json, written by
training/memory_report.py) vs predicted (planning/memory.py) per rank and category.

Measured, per rank:
- params / grads / optimizer: bytes of the tensors actually allocated (census after step 1,
  when Adam's states exist);
- runtime: resident memory before the model was built (the planner takes it as given: it
  cannot predict what torch and the libraries map);
- forward_backward: the largest (peak of the forward/backward phase - resident at the
  step's start) over plain steps >= 2 (no save, no evaluation), against the planner's
  max(activations, collective transient): the grad reduce-scatter at the phase's end
  stages a whole buffer on gloo (records without phases: the whole step's peak);
- optimizer_step: the largest (peak of the grad-norm + optimizer-step + param all-gather
  phase - resident at the backward's end) over the same steps;
- checkpoint save: the same over save steps (the save follows the backward, whose
  activations are freed by then, so the step's peak is the save's when it is larger);
- total: the largest resident peak over plain steps >= 2 before the first save (VmHWM);
- total_with_save: the largest peak over all steps >= 2, against runtime + static +
  max(forward_backward, optimizer_step, save) (after a save the process keeps that
  high-water mark);
- resident_at_step_start: the resident set when that step began, against runtime + the
  static categories: the difference is what the allocator and libraries hold beyond the
  tensors (it explains most of a gap in the total).
Targets (issue 21): params/grads/optimizer within 2 %, forward_backward, optimizer_step and
total within 15 %.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional

from megatron_mvmoe.planning.plan import PlanTarget
from megatron_mvmoe.planning.memory import rank_memory
from megatron_mvmoe.config.run_config import load_yaml
from megatron_mvmoe.config.run_dir import MEMORY_DIR


def load_records(run_dir: str) -> List[Dict]:
    """Every rank's record of a run directory, by rank."""
    folder = os.path.join(run_dir, MEMORY_DIR)
    if not os.path.isdir(folder):
        raise ValueError(f"--validate: {run_dir} has no {MEMORY_DIR}/ folder. Fix: pass the "
                         "run_dir of a run trained with this version (it writes "
                         f"{MEMORY_DIR}/rank<R>.json from step 2 on)")
    records = []
    for name in sorted(os.listdir(folder)):
        if re.fullmatch(r"rank\d+\.json", name):
            with open(os.path.join(folder, name)) as fh:
                records.append(json.load(fh))
    return sorted(records, key=lambda r: r["rank"])


TARGET_PERCENT = {"params": 2.0, "grads": 2.0, "optimizer": 2.0, "forward_backward": 15.0,
                  "optimizer_step": 15.0, "total": 15.0, "checkpoint_save_transient": None, "runtime": None,
                  "resident_at_step_start": None, "total_with_save": 15.0}
CATEGORIES = tuple(TARGET_PERCENT)


def _plain_steps(record: Dict) -> List[Dict]:
    """Steps >= 2 without save or evaluation, before the first save where there are such:
    glibc keeps the heap the save's clones freed (medium blocks fall under its dynamic mmap
    threshold), so after a save every step starts from the save's high-water mark."""
    first = record["steps"][0]["step"] if record["steps"] else 0
    plain = [s for s in record["steps"] if s["step"] > max(1, first) and not s["saved"]
             and not s["evaluated"] and s["start_rss"] is not None]
    first_save = min((s["step"] for s in record["steps"] if s["saved"]), default=None)
    before = [s for s in plain if first_save is None or s["step"] < first_save]
    return before or plain


def measured(record: Dict) -> Dict[str, Optional[float]]:
    census = record.get("census")
    if census is None:
        raise ValueError(f"--validate: rank {record['rank']} recorded no step after the "
                         "first. Fix: validate a run of at least 3 steps")
    plain = _plain_steps(record)
    act = max((_phase(s, "backward", "peak_rss", s["peak_rss"]) - s["start_rss"]
               for s in plain), default=None)
    opt = [_phase(s, "optimizer", "peak_rss") - _phase(s, "backward", "end_rss")
           for s in plain if "phases" in s and "optimizer" in s["phases"]]
    top = max(plain, key=lambda s: s["peak_rss"], default=None)
    # The save runs after the step's backward (activations freed): its own peak.
    saves = [s["peak_rss"] - s["start_rss"] for s in record["steps"]
             if s["saved"] and s["start_rss"] is not None]
    return {"params": float(census["params"] + census.get("module_buffers", 0)),
            "grads": float(census["grads"]), "optimizer": float(census["optimizer"]),
            "runtime": float(record["runtime_rss"]), "forward_backward": act,
            "optimizer_step": float(max(opt)) if opt else None,
            "checkpoint_save_transient": max(saves) if saves else None,
            "total": None if top is None else float(top["peak_rss"]),
            "resident_at_step_start": None if top is None else float(top["start_rss"]),
            "total_with_save": (max(float(s["peak_rss"]) for s in record["steps"]
                                    if s["start_rss"] is not None) if saves and plain
                                else None)}


def _phase(step: Dict, phase: str, key: str, default: Optional[int] = None) -> Optional[int]:
    """One phase's figure of a step record (memory_report.py); `default` for records
    written before phases were recorded."""
    return step.get("phases", {}).get(phase, {}).get(key, default)


def timings(record: Dict) -> Dict[str, Optional[float]]:
    """Seconds of a plain step (median), of each save beyond a plain step, and from start-up
    to the first step (build, plus the load when resumed)."""
    import statistics

    plain = [s["seconds"] for s in _plain_steps(record) if "seconds" in s]
    step = statistics.median(plain) if plain else None
    saves = [s["seconds"] - step for s in record["steps"]
             if s["saved"] and "seconds" in s and step is not None]
    return {"step_seconds": step, "save_seconds": saves or None,
            "seconds_to_first_step": record.get("seconds_to_first_step")}


def validate(run_dir: str) -> Dict:
    """{"ranks": [{rank, stage, rows: {category: {measured, predicted, diff_percent,
    target_percent, within}}}], "config": path}."""
    config = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config):
        raise ValueError(f"--validate: {run_dir} has no config.yaml. Fix: pass a run_dir "
                         "written by megatron_mvmoe.training.pretrain")
    run = load_yaml(config)
    records = load_records(run_dir)
    world = records[0].get("world_size", len(records))
    t = run.training
    target = PlanTarget(run.parallel.layout(), world_size=world,
                        micro_batch_size=t.micro_batch_size,
                        global_batch_size=t.global_batch_size)
    ranks = []
    for record in records:
        precision = "gpu_bf16" if record.get("bf16") else "cpu_fp32"
        got = measured(record)
        want = rank_memory(run.model, target, record["pp_rank"], precision,
                           run.optimizer.use_distributed_optimizer, got["runtime"],
                           writes=(record.get("dp_rank", 0) == 0,
                                   record.get("expert_dp_rank", 0) == 0))
        want["resident_at_step_start"] = (got["runtime"] + want["params"] + want["grads"]
                                          + want["optimizer"])
        want["optimizer_step"] = want["optimizer_step_transient"]
        rows = {c: _row(got[c], want[c], TARGET_PERCENT[c]) for c in CATEGORIES}
        ranks.append({"rank": record["rank"], "stage": record["pp_rank"],
                      "ep_rank": record.get("ep_rank"), "precision": precision,
                      "rows": rows, "timings": timings(record)})
    return {"run_dir": run_dir, "world_size": world, "layout": target.as_dict(),
            "ranks": ranks, "all_within": all(r["within"] is not False for rank in ranks
                                              for r in rank["rows"].values())}


def _row(got: Optional[float], want: float, target: Optional[float]) -> Dict:
    diff = None if got is None or want == 0 else 100.0 * (got - want) / want
    within = None if diff is None or target is None else abs(diff) <= target
    return {"measured": got, "predicted": want, "diff_percent": diff,
            "target_percent": target, "within": within}


def table_lines(report: Dict) -> List[str]:
    gib = lambda b: "-" if b is None else f"{b / 2**30:8.3f}"
    lines = [f"planner vs measured: {report['run_dir']} (world {report['world_size']}, "
             f"layout {report['layout']})"]
    for rank in report["ranks"]:
        lines.append(f"rank {rank['rank']} (stage {rank['stage']}, ep rank {rank['ep_rank']},"
                     f" {rank['precision']}):  GiB measured / predicted / diff")
        for name, r in rank["rows"].items():
            diff = "-" if r["diff_percent"] is None else f"{r['diff_percent']:+6.1f}%"
            mark = {True: "ok", False: "OUTSIDE", None: ""}[r["within"]]
            target = "" if r["target_percent"] is None else f"(target {r['target_percent']:.0f}%)"
            lines.append(f"  {name:26s} {gib(r['measured'])} {gib(r['predicted'])} "
                         f"{diff:>8s} {target} {mark}")
        t = rank["timings"]
        sec = lambda v: "-" if v is None else f"{v:.1f} s"
        saves = ", ".join(f"{v:.1f} s" for v in t["save_seconds"] or []) or "-"
        lines.append(f"  time: step {sec(t['step_seconds'])}, save(s) beyond a step {saves}, "
                     f"start-up to step 1 {sec(t['seconds_to_first_step'])}")
    return lines
