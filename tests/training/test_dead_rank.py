"""A rank dying mid-training ends the job with a clear error in bounded time (torchrun
stops the survivors), and a rerun resumes from the last good checkpoint. A crash in the
middle of a save leaves `latest` pointing at the previous complete checkpoint."""

import os
import subprocess
import sys
import time

import pytest
import yaml
from textdata import build_token_dir

from megatron_mvmoe.checkpointing.directory import resolve_checkpoint
from megatron_mvmoe.checkpointing.errors import CheckpointError

HERE = os.path.dirname(os.path.abspath(__file__))


def _yaml(tmp_path, data_dir, timeout_s: float = 30) -> str:
    raw = dict(model=dict(preset="tiny_smoe", vocab_size=512, seq_length=32),
               parallel=dict(ep=2, distributed_timeout_seconds=timeout_s),
               data=dict(kind="tokens", path=data_dir),
               optimizer=dict(lr=3e-3, min_lr=3e-4),
               training=dict(train_iters=4, global_batch_size=8, micro_batch_size=2,
                             eval_interval=0, eval_iters=0, save_interval=2,
                             save=str(tmp_path / "ck")),
               logging=dict(log_interval=1, tensorboard=False))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _torchrun(config: str, kill_at: str, extra=(), **env_vars):
    env = dict(os.environ, KILL_AT_STEP=kill_at, OMP_NUM_THREADS="1", **env_vars)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(HERE, "kill_rank_job.py"), "--config", config, *extra]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    return proc, time.monotonic() - start


@pytest.mark.timeout(900)
def test_dead_rank_fails_clearly_then_resume(tmp_path):
    data_dir = build_token_dir(str(tmp_path / "tokens"))
    config = _yaml(tmp_path, data_dir)
    proc, seconds = _torchrun(config, kill_at="3")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "exitcode" in out and "-9" in out and "rank: 1" in out, out[-3000:]
    assert resolve_checkpoint(str(tmp_path / "ck")).endswith("iter_0000002")
    proc, _ = _torchrun(config, kill_at="never", extra=("--load", str(tmp_path / "ck")))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "resumed from" in out and "at step 2" in out
    assert "step      4/4" in out


def test_half_written_save_keeps_latest(tmp_path):
    root = tmp_path / "ck"
    good = root / "iter_0000002"
    good.mkdir(parents=True)
    (good / "run_state.json").write_text("{}")
    (root / "latest").write_text("iter_0000002\n")
    (root / ".tmp_iter_0000004").mkdir()  # a crash during the next save left this
    assert resolve_checkpoint(str(root)) == str(good)
    (root / "latest").write_text("iter_0000004\n")  # pointer to a directory never renamed
    with pytest.raises(CheckpointError, match="points at 'iter_0000004', which is missing"):
        resolve_checkpoint(str(root))


@pytest.mark.timeout(300)
def test_hung_rank_makes_survivor_exit_within_timeout(tmp_path):
    """SIGSTOP rank 1 at step 2: rank 0 blocks in the expert-parallel all-to-all (a
    Megatron subgroup, so this needs the run's timeout on every group, not Megatron's
    30 minutes) and must exit within distributed_timeout_seconds + a margin."""
    timeout_s, margin_s = 10, 20
    data_dir = build_token_dir(str(tmp_path / "tokens"))
    config = _yaml(tmp_path, data_dir, timeout_s=timeout_s)
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    proc, _ = _torchrun(config, kill_at="2", STOP_MODE="stop", EXIT_TIMES_DIR=str(stamps))
    assert proc.returncode != 0
    stopped = float((stamps / "stopped").read_text())
    survivor = float((stamps / "exit_rank_0").read_text())
    print(f"hung rank: survivor exited {survivor - stopped:.1f} s after rank 1 stopped "
          f"(timeout {timeout_s} s)")
    assert timeout_s * 0.5 <= survivor - stopped <= timeout_s + margin_s, \
        (survivor - stopped, (proc.stdout + proc.stderr)[-3000:])
