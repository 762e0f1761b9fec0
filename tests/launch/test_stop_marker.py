"""Finding 1 of issue 25: a stale `stopped_early.json` (left by a `scancel` that saved) must
never requeue a later job that crashes. The marker names the run that wrote it
(`<SLURM_JOB_ID>.<SLURM_RESTART_COUNT>`), the recipes delete it before the trainer starts,
and only a marker of this very run requeues (megatron_mvmoe.training.job_end).

The first test runs the recipes' own shell functions (examples/slurm/requeue_on_stop.sh)
around the real trainer failing on `--no-such-flag`; before the fix it printed
"stopped early (...): requeueing job 7". test_two_node_stops.py re-runs it on the 2-node
Slurm cluster."""

import json
import os
import subprocess
import sys
from pathlib import Path

from megatron_mvmoe.training import job_end
from megatron_mvmoe.training.stopping import EXIT_REQUEUE, STOPPED_MARKER, marker_payload

REPO = Path(__file__).resolve().parents[2]
RECIPE_BODY = """set -euo pipefail
source examples/slurm/requeue_on_stop.sh
start_run
status=0
"$PYTHON" -m megatron_mvmoe.training.pretrain --save "$SAVE" --load "$SAVE" "$@" || status=$?
requeue_on_stop "$status"
"""
"""The lines of examples/slurm/pretrain_one_task_per_gpu.sbatch around its srun."""


def write_marker(save: Path, run: str, step: int = 5) -> None:
    save.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, MVMOE_RUN_ID=run)
    code = ("import json, sys; from megatron_mvmoe.training.stopping import marker_payload; "
            f"print(json.dumps(marker_payload({step}, 'SIGTERM received', 'ck/iter_5')))")
    text = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, check=True).stdout
    (save / STOPPED_MARKER).write_text(text)


def test_marker_names_the_run_that_stopped(monkeypatch):
    monkeypatch.delenv("MVMOE_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert marker_payload(7, "SIGUSR1 received", "x")["run_id"] == "41.2"
    monkeypatch.setenv("MVMOE_RUN_ID", "local.9")
    assert marker_payload(7, "SIGUSR1 received", "x")["run_id"] == "local.9"


def test_only_this_runs_marker_requeues(tmp_path, monkeypatch, capsys):
    save = tmp_path / "ck"
    write_marker(save, run="7.0")
    monkeypatch.setenv("MVMOE_RUN_ID", "7.0")  # the run that stopped: requeue
    assert job_end.main(["--status", "1", "--save", str(save)]) == EXIT_REQUEUE
    assert "stopped early (SIGTERM received) at step 5 in run 7.0" in capsys.readouterr().out
    for other in ("7.1", "6.0"):  # a later restart, another job: stale, never requeues
        monkeypatch.setenv("MVMOE_RUN_ID", other)
        assert job_end.main(["--status", "2", "--save", str(save), "--json"]) == 0
        verdict = json.loads(capsys.readouterr().out)
        assert verdict["kind"] == "failed" and not verdict["requeue"]
        assert f"ignored a stale {STOPPED_MARKER} of run 7.0, not this run {other}" in \
            verdict["line"]


def test_flag_error_after_a_saved_scancel_is_not_requeued(tmp_path):
    """Job 6 was scancel'd after saving (its marker stays); job 7 on the same --save fails
    on a flag: one summary line, status 2, no requeue."""
    save = tmp_path / "ck"
    write_marker(save, run="6.0")
    env = dict(os.environ, SAVE=str(save), PYTHON=sys.executable, SLURM_JOB_ID="7",
               SLURM_RESTART_COUNT="0", OMP_NUM_THREADS="1")
    env.pop("MVMOE_RUN_ID", None)
    proc = subprocess.run(["bash", "-c", RECIPE_BODY, "recipe", "--no-such-flag"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "requeue" not in out, out[-3000:]
    assert "--no-such-flag" in proc.stderr
    assert not (save / STOPPED_MARKER).exists()
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("job failed (exit status 2): before training started"), out
