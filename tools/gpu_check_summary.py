"""tools/gpu_check.sh's verdicts: the resume check and $OUT/summary.json.

    python tools/gpu_check_summary.py resume OUT STEP   # exit 1 unless the resume is exact
    python tools/gpu_check_summary.py summary OUT       # exit 1 unless every stage exited 0

`resume`: the run resumed from the checkpoint at STEP (OUT/train_resume) logs the same losses
and gradient norms for steps STEP+1.. as the uninterrupted run (OUT/train_tiny), bit for bit
(both read from metrics.jsonl, whose floats round-trip exactly); every loss is finite; the
last loss is below the first. Checked by tests/launch/test_gpu_check.py.
"""
from __future__ import annotations

import json
import math
import pathlib
import sys

LAYER_KEYS = ("median_s", "achieved_tflops", "memory_bytes", "planned_bytes", "time_ratio",
              "flop_ratio")


def train_records(run_dir: pathlib.Path) -> dict:
    """{step: (loss, grad_norm)} of a run's metrics.jsonl."""
    records = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "train":
            records[row["step"]] = (row["loss"], row.get("grad_norm"))
    return records


def resume_verdict(out: pathlib.Path, resumed_at: int) -> dict:
    """The resume check's figures; 'ok' is the verdict, 'why' names what failed."""
    full, resumed = train_records(out / "train_tiny"), train_records(out / "train_resume")
    losses = [full[s][0] for s in sorted(full)]
    expected = {s: v for s, v in full.items() if s > resumed_at}
    verdict = {"steps": len(full), "first_loss": losses[0] if losses else None,
               "last_loss": losses[-1] if losses else None, "resumed_at": resumed_at,
               "resumed_steps": sorted(resumed)}
    if not expected or sorted(resumed) != sorted(expected):
        why = f"resumed steps {sorted(resumed)}, expected {sorted(expected)}"
    elif any(resumed[s] != expected[s] for s in expected):
        step = next(s for s in sorted(expected) if resumed[s] != expected[s])
        why = f"step {step}: resumed {resumed[step]} != uninterrupted {expected[step]}"
    elif not all(math.isfinite(v) for v in losses):
        why = f"non-finite loss in {losses}"
    elif not losses[-1] < losses[0]:
        why = f"loss did not fall: {losses[0]} -> {losses[-1]}"
    else:
        why = ""
    return dict(verdict, ok=not why, why=why)


def stage_table(out: pathlib.Path) -> dict:
    stages = {}
    for line in (out / "stages.tsv").read_text().splitlines():
        name, rc, seconds, reason = (line.split("\t") + [""])[:4]
        stages[name] = {"exit": int(rc), "seconds": int(seconds), "reason": reason}
    return stages


def layer_figures(out: pathlib.Path):
    try:
        layer = json.loads((out / "layer_10b.out").read_text())
        return {v: {k: r[k] for k in LAYER_KEYS} for v, r in layer["variants"].items()}
    except (OSError, ValueError, KeyError) as err:
        return f"unavailable: {err}"


def attention_figures(out: pathlib.Path):
    """Which aten SDPA kernel ran, torch.backends.cuda's switches, TFLOP/s (bench_attention)."""
    try:
        attention = json.loads((out / "attention.out").read_text())
        return {k: attention[k] for k in ("sdpa_kernels", "sdpa_switches", "tflops",
                                          "sdpa_over_unfused")}
    except (OSError, ValueError, KeyError) as err:
        return f"unavailable: {err}"


def summary(out: pathlib.Path) -> dict:
    stages = stage_table(out)
    result = {"stages": stages, "layer_10b": layer_figures(out),
              "attention": attention_figures(out)}
    if isinstance(result["layer_10b"], dict):
        result["mv_over_baseline_time"] = result["layer_10b"]["multi_view"]["time_ratio"]
    try:
        result["resume"] = resume_verdict(out, json.loads(
            (out / "resume_check.out").read_text())["resumed_at"])
    except (OSError, ValueError, KeyError) as err:
        result["resume"] = f"unavailable: {err}"
    return result


def main(argv: list) -> int:
    argv = [a for a in argv if a != "--json"]  # its output is JSON already (--json accepted)
    if len(argv) == 3 and argv[0] == "resume":
        try:
            verdict = resume_verdict(pathlib.Path(argv[1]), int(argv[2]))
        except (OSError, ValueError, KeyError) as err:
            print(f"resume check: no training log to compare ({err})", file=sys.stderr)
            return 1
        print(json.dumps(verdict))
        if not verdict["ok"]:
            print(f"resume check: {verdict['why']}", file=sys.stderr)
        return 0 if verdict["ok"] else 1
    if len(argv) == 2 and argv[0] == "summary":
        out = pathlib.Path(argv[1])
        result = summary(out)
        (out / "summary.json").write_text(json.dumps(result, indent=1))
        print(json.dumps(result, indent=1))
        return 0 if all(s["exit"] == 0 for s in result["stages"].values()) else 1
    print("usage: gpu_check_summary.py resume OUT STEP | summary OUT [--json] (JSON out)",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
