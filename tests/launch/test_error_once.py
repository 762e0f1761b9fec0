"""A failing multi-rank run prints its error once, on a line of its own, with the rank that
raised it, and the documented launcher (examples/launch/torchrun_local.sh, through
megatron_mvmoe.launch.torchrun) ends with the trainer's exit status: 2 for bad input.
Before (ecf52e9): every rank printed the error, torchrun's 25-line ChildFailedError block
followed, and the launcher exited 1. A rank stopped (SIGSTOP) under plain torchrun was 200
lines of gloo traceback; now the survivor prints one line naming the timeout and the rank."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from test_torchrun_signals import (PACED_JOB, launch_plain_torchrun, processes_mentioning,
                                   run_yaml, trainer, wait_for)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "launch" / "torchrun_local.sh"


def _lines(capfd) -> list:
    return capfd.readouterr().err.splitlines()


def test_a_config_error_is_printed_by_rank_0_only(capfd, monkeypatch):
    from megatron_mvmoe.training import error_once

    monkeypatch.setenv("RANK", "1")
    error_once.config_error(ValueError("training.train_iters: bad"))
    assert _lines(capfd) == []
    monkeypatch.setenv("RANK", "0")
    error_once.config_error(ValueError("training.train_iters: bad"))
    assert _lines(capfd) == ["error: training.train_iters: bad"]


def test_the_same_error_of_two_ranks_once_a_different_one_too(capfd, monkeypatch):
    from megatron_mvmoe.training import error_once

    store = dist.HashStore()
    for rank, message in [(1, "same"), (0, "same"), (0, "other\nsecond line")]:
        monkeypatch.setenv("RANK", str(rank))
        error_once.rank_error(ValueError(message), store)
    assert _lines(capfd) == ["error (rank 1): same", "error (rank 0): other",
                             "second line"]


@pytest.mark.launchers
@pytest.mark.timeout(300)
def test_bad_data_path_under_the_launcher_once_with_status_2(tmp_path):
    """Both ranks raise the same error after torch.distributed started."""
    prefix = tmp_path / "missing_text_document"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", NPROC="2")
    proc = subprocess.run([str(SCRIPT), "-m", "megatron_mvmoe.training.pretrain", "--config",
                           "examples/tiny_cpu.yaml", "--data-path", str(prefix)], cwd=REPO,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=280)
    out = proc.stdout
    errors = [line for line in out.splitlines() if f"data prefix '{prefix}' not found" in line]
    assert proc.returncode == 2, out[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error (rank "), out[-3000:]
    assert "ChildFailedError" not in out and "Traceback" not in out, out[-3000:]
    assert "torchrun: rank " in out and " exited with status 2 first" in out, out[-3000:]
    assert out.strip().splitlines()[-1].startswith("job failed (exit status 2)"), out[-3000:]


@pytest.mark.launchers
@pytest.mark.timeout(300)
def test_a_stopped_rank_under_plain_torchrun_is_one_line(tmp_path, text_tokens):
    save, out = tmp_path / "ck", tmp_path / "out.txt"
    config = run_yaml(tmp_path, text_tokens, timeout_s=10)  # 5 s flaked once at load 36
    proc = launch_plain_torchrun([PACED_JOB, *trainer(config, save, tmp_path / "run")[2:]],
                                 out, STOP_RANK_1_AT_STEP="2")
    try:
        text = wait_for(out, r"error \(rank 0\): a collective timed out.*\n", 200)
    finally:  # torchrun would wait 30 s before it SIGKILLs the stopped rank
        for pid, _ in processes_mentioning(str(save)):
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
    line = re.search(r"error \(rank 0\): a collective timed out.*", text).group(0)
    assert re.match(r"error \(rank 0\): a collective timed out after 10 s \(parallel\."
                    r"distributed_timeout_seconds\): rank 1 \(PID \d+ on .+\) is stopped "
                    r"\(SIGSTOP\) \[.*\]\. Fix: ", line), line
    text = out.read_text(errors="replace")  # the agent's own report included
    assert [l for l in text.splitlines() if "Timed out waiting" in l] == [line], text[-3000:]
    assert "megatron_mvmoe/training/" not in text, text[-3000:]  # no worker traceback
