"""Issue 25 findings 1, 3 and 6 on the 2-node Slurm cluster (tools/slurm_local.py, brought up
by test_two_node_slurm.py's fixture), through examples/slurm/pretrain_multinode.sbatch, all
on one holder job (one launch for both findings):

- finding 3: a second job on the same $SAVE, while the first trains across both nodes, is
  refused with one line naming the holder's node, job and PID;
- finding 1 as written: a plain `scancel` of the holder saves and leaves
  `stopped_early.json`; the next job on the same $SAVE fails on `--no-such-flag` and must end
  FAILED, not requeued (it was requeued every ~2 min up to MAX_RESTARTS), with one summary
  line last.
"""

import re
import time

import pytest
from test_two_node_slurm import (FINAL, _client, _log, _state, _submit, _wait,  # noqa: F401
                                 cluster, config)

pytestmark = [pytest.mark.launchers, pytest.mark.slow, pytest.mark.timeout(900)]
SHARED = ("--oversubscribe",)  # both jobs on both nodes at once


def _final(cluster, job: str, timeout_s: float, what: str) -> str:
    return _wait(cluster, job, lambda s: s.get("JobState") in FINAL and s["JobState"],
                 timeout_s, what)


def _second_job_is_refused(cluster, config, save, first: str, log) -> str:
    """Finding 3: a job on the holder's $SAVE ends FAILED, never trains, and its one line
    names the holder's node, job and PID."""
    second = _submit(cluster, "torchrun", config, save, log, sbatch_opts=SHARED)
    state = _final(cluster, second, 300, "end")
    assert _state(cluster, first)["JobState"] == "RUNNING"  # untouched by the second
    text = _log(log)
    refused = [l for l in text.splitlines() if "is in use by another training" in l]
    assert state == "FAILED" and refused, text[-3000:]
    assert re.search(rf"\(host n[12], job {first}, PID \d+, since ", refused[0]), refused[0]
    assert f"Fix: wait for it to end, stop it (scancel {first})" in refused[0]
    assert not re.search(r"step +\d+/", text) and "requeue" not in text  # never trained
    return refused[0]


def _flag_error_is_not_requeued(cluster, config, save, log) -> str:
    """Finding 1: with the scancel's `stopped_early.json` in $SAVE, a job failing on
    `--no-such-flag` ends FAILED, not requeued, with one summary line last."""
    job = _submit(cluster, "torchrun", config, save, log, "--no-such-flag")
    state = _final(cluster, job, 240, "end")
    time.sleep(5)  # a requeue would show now
    after = _state(cluster, job)
    text = _log(log)
    assert state == "FAILED" and after["JobState"] == "FAILED", (after, text[-3000:])
    assert int(after.get("Restarts", 0)) == 0 and "requeue" not in text, text[-3000:]
    assert "--no-such-flag: unknown flag" in text
    last = text.strip().splitlines()[-1]
    assert last.startswith("job failed (exit status") and "before training started" in last
    assert f"--load {save} --ckpt-step" in last, last
    return f"job {job}: {after['JobState']}, Restarts {after.get('Restarts')}; last line: {last}"


def test_a_second_job_is_refused_then_a_flag_error_after_the_scancel_is_not_requeued(
        cluster, config, tmp_path):
    """One holder job serves both findings (two launches of it cost 52 s + 67 s in CI): while
    it trains on both nodes, a second job on its $SAVE is refused (--oversubscribe lifts the
    recipe's --exclusive: the cluster has only these two nodes, as a copy-pasted sbatch line
    would be elsewhere); then a plain `scancel` of the holder saves and leaves
    `stopped_early.json`, and the next job, failing on a flag, is not requeued."""
    save, first_log = tmp_path / "ck", tmp_path / "first.out"
    # the holder trains until cancelled: 400 steps once ended (at load 20) before the
    # second job's ranks had started, which then found the lock free
    first = _submit(cluster, "torchrun", config, save, first_log, "--train-iters", "100000",
                    sbatch_opts=SHARED)
    try:
        _wait(cluster, first, lambda s: re.search(r"step +2/", _log(first_log)), 240,
              "step 2")
        refused = _second_job_is_refused(cluster, config, save, first, tmp_path / "second.out")
        assert _client(cluster, ["scancel", first]).returncode == 0
        assert _final(cluster, first, 120, "end after scancel") == "CANCELLED"
    finally:
        _client(cluster, ["scancel", first])
    text = _log(first_log)
    assert re.search(r"stopping after step \d+: SIGTERM received", text), text[-3000:]
    assert (save / "stopped_early.json").exists()  # what used to requeue the next job
    third = _flag_error_is_not_requeued(cluster, config, save, tmp_path / "third.out")
    print(f"second job on the same $SAVE as {first}: {refused}\nscancel {first}, then "
          f"--no-such-flag {third}")
