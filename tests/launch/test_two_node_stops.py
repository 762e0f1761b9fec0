"""Issue 25 findings 1, 3 and 6 on the 2-node Slurm cluster (tools/slurm_local.py, brought up
by test_two_node_slurm.py's fixture), through examples/slurm/pretrain_multinode.sbatch:

- finding 1 as written: a plain `scancel` saves and leaves `stopped_early.json`; the next
  job on the same $SAVE fails on `--no-such-flag` and must end FAILED, not requeued (it
  was requeued every ~2 min up to MAX_RESTARTS), with one summary line last;
- finding 3: a second job on the same $SAVE, while the first trains across both nodes, is
  refused with one line naming the holder's node, job and PID.
"""

import re
import time

import pytest
from test_two_node_slurm import (FINAL, _client, _log, _state, _submit, _wait,  # noqa: F401
                                 cluster, config)

pytestmark = [pytest.mark.launchers, pytest.mark.slow, pytest.mark.timeout(900)]


def _final(cluster, job: str, timeout_s: float, what: str) -> str:
    return _wait(cluster, job, lambda s: s.get("JobState") in FINAL and s["JobState"],
                 timeout_s, what)


def test_flag_error_after_a_saved_scancel_is_not_requeued(cluster, config, tmp_path):
    save = tmp_path / "ck"
    first_log, second_log = tmp_path / "first.out", tmp_path / "second.out"
    first = _submit(cluster, "torchrun", config, save, first_log)
    _wait(cluster, first, lambda s: re.search(r"step +3/", _log(first_log)), 240, "step 3")
    assert _client(cluster, ["scancel", first]).returncode == 0
    assert _final(cluster, first, 120, "end after scancel") == "CANCELLED"
    text = _log(first_log)
    assert re.search(r"stopping after step \d+: SIGTERM received", text), text[-3000:]
    assert (save / "stopped_early.json").exists()  # what used to requeue the next job

    second = _submit(cluster, "torchrun", config, save, second_log, "--no-such-flag")
    state = _final(cluster, second, 240, "end")
    time.sleep(5)  # a requeue would show now
    after = _state(cluster, second)
    text = _log(second_log)
    assert state == "FAILED" and after["JobState"] == "FAILED", (after, text[-3000:])
    assert int(after.get("Restarts", 0)) == 0 and "requeue" not in text, text[-3000:]
    assert "--no-such-flag: unknown flag" in text
    last = text.strip().splitlines()[-1]
    assert last.startswith("job failed (exit status") and "before training started" in last
    assert f"--load {save} --ckpt-step" in last, last
    print(f"scancel {first}, then job {second} with --no-such-flag: {after['JobState']}, "
          f"Restarts {after.get('Restarts')}; last line: {last}")


def test_second_job_on_the_same_save_is_refused_naming_the_holder(cluster, config, tmp_path):
    """Both jobs on both nodes at once (--oversubscribe lifts the recipe's --exclusive: the
    cluster has only these two nodes), as a copy-pasted sbatch line would be elsewhere."""
    save, shared = tmp_path / "ck", ("--oversubscribe",)
    first_log, second_log = tmp_path / "first.out", tmp_path / "second.out"
    # the holder trains until cancelled: 400 steps once ended (at load 20) before the
    # second job's ranks had started, which then found the lock free
    first = _submit(cluster, "torchrun", config, save, first_log, "--train-iters", "100000",
                    sbatch_opts=shared)
    try:
        _wait(cluster, first, lambda s: re.search(r"step +2/", _log(first_log)), 240,
              "step 2")
        second = _submit(cluster, "torchrun", config, save, second_log, sbatch_opts=shared)
        state = _final(cluster, second, 300, "end")
        assert _state(cluster, first)["JobState"] == "RUNNING"  # untouched by the second
    finally:
        _client(cluster, ["scancel", first])
    text = _log(second_log)
    refused = [l for l in text.splitlines() if "is in use by another training" in l]
    assert state == "FAILED" and refused, text[-3000:]
    assert re.search(rf"\(host n[12], job {first}, PID \d+, since ", refused[0]), refused[0]
    assert f"Fix: wait for it to end, stop it (scancel {first})" in refused[0]
    assert not re.search(r"step +\d+/", text) and "requeue" not in text  # never trained
    print(f"second job {second} on the same $SAVE: {refused[0]}\nlast line: "
          f"{text.strip().splitlines()[-1]}")
