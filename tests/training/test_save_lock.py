"""Finding 3 of issue 25: one writer per --save directory (training/save_lock.py).

- Two processes: while one holds the lock, the other is refused with one line naming the
  holder (host, job, PID) and the fix; once the holder is SIGKILLed (a crash: nothing
  released) the next one takes the lock over and names whose it was.
- Without flock (some parallel file systems): a dead PID on this host, or an earlier
  restart of this very Slurm job, is taken over; another host's lock is refused with the
  file to delete by hand.
- Two real trainings on one --save: the second exits 2 with that one line and writes
  nothing; before the fix both trained and wrote iter_* and `latest` into one directory.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_mvmoe.testing.spawn import run_distributed
from megatron_mvmoe.training.save_lock import (LOCK_NAME, Holder, SaveLock, hold_save_lock,
                                              host_name)

HOLD = """
import sys, time
from megatron_mvmoe.training.save_lock import SaveLock
lock = SaveLock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


def hold_in_another_process(save: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MVMOE_"))}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(save)], stdout=subprocess.PIPE,
                            text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_writer_refused_naming_the_holder_then_a_dead_holder_is_taken_over(tmp_path):
    save = tmp_path / "ck"
    holder = hold_in_another_process(save)
    try:
        with pytest.raises(ValueError) as refused:
            SaveLock.acquire(str(save))
        line = str(refused.value)
        assert "\n" not in line and line.startswith(f"--save: {save} is in use by another "
                                                    "training")
        assert f"host {host_name()}, no Slurm job, PID {holder.pid}, since " in line
        assert f"Fix: wait for it to end, stop it (kill {holder.pid} on {host_name()})" in line
    finally:
        holder.kill()  # SIGKILL: the lock file stays, the kernel drops the lock
        holder.wait()
    assert (save / LOCK_NAME).exists()
    lock = SaveLock.acquire(str(save))
    assert lock.previous is not None and lock.previous.pid == holder.pid
    assert json.loads((save / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    assert not (save / LOCK_NAME).exists()
    SaveLock.acquire(str(save)).release()  # free again


def _write_holder(save: Path, **fields) -> None:
    save.mkdir(parents=True, exist_ok=True)
    base = dict(host=host_name(), pid=os.getpid(), job=None, run_id=None, since="then")
    (save / LOCK_NAME).write_text(json.dumps({**base, **fields}))


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_without_flock_only_a_surely_gone_holder_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.delenv("MVMOE_RUN_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    save, path = tmp_path / "ck", str(tmp_path / "ck" / LOCK_NAME)

    def acquire():
        return SaveLock._acquire_by_existence(str(save), path)

    _write_holder(save, pid=_dead_pid())  # this host, process gone
    lock = acquire()
    assert lock.previous is not None and Holder.parse(Path(path).read_text()).job == "7"
    lock.release()
    _write_holder(save, host="elsewhere", pid=1, job="7", run_id="7.0")  # earlier restart
    acquire().release()
    for alive in (dict(pid=os.getppid()),  # this host, alive
                  dict(host="elsewhere", pid=1, job="5", run_id="5.0"),  # can't tell
                  dict(host="elsewhere", pid=1, job="7", run_id="7.1")):  # this very run
        _write_holder(save, **alive)
        with pytest.raises(ValueError, match=f"if that run is gone, delete {path}"):
            acquire()


def _yaml(folder: Path, tokens: str) -> str:
    raw = dict(model=dict(preset="tiny_smoe", vocab_size=512, seq_length=32),
               parallel=dict(ep=1),
               data=dict(kind="tokens", path=tokens),
               optimizer=dict(lr=3e-3, min_lr=3e-4),
               training=dict(train_iters=400, global_batch_size=4, micro_batch_size=2,
                             eval_interval=0, eval_iters=0, save_interval=10_000,
                             save=str(folder / "ck")),
               logging=dict(log_interval=1, tensorboard=False, routing_metrics=False))
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _trainer(config: str, out: Path, *extra) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MVMOE_"))}
    with open(out, "w") as fh:
        return subprocess.Popen([sys.executable, "-m", "megatron_mvmoe.training.pretrain",
                                 "--config", config, *extra], stdout=fh,
                                stderr=subprocess.STDOUT, env=dict(env, OMP_NUM_THREADS="1"))


def _wait_for(out: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in out.read_text():
        assert time.monotonic() < deadline, out.read_text()[-3000:]
        time.sleep(0.3)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_trainings_on_one_save_the_second_is_refused(tmp_path, text_tokens):
    config, save = _yaml(tmp_path, text_tokens), tmp_path / "ck"
    first_out, second_out = tmp_path / "first.txt", tmp_path / "second.txt"
    first = _trainer(config, first_out, "--run-dir", str(tmp_path / "run1"))
    try:
        _wait_for(first_out, "step      2/400", 300)
        second = _trainer(config, second_out, "--run-dir", str(tmp_path / "run2"))
        assert second.wait(timeout=300) == 2
        errors = [l for l in second_out.read_text().splitlines() if l.startswith("error:")]
        assert len(errors) == 1 and f"PID {first.pid}" in errors[0], second_out.read_text()
        assert "is in use by another training" in errors[0] and "Fix:" in errors[0]
        assert "step " not in second_out.read_text()  # it never trained
        first.send_signal(signal.SIGTERM)  # the holder still saves, then frees the lock
        assert first.wait(timeout=300) == 3, first_out.read_text()[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
    assert not (save / LOCK_NAME).exists()
    saved = sorted(p.name for p in save.glob("iter_*"))
    assert len(saved) == 1  # only the first run's stop save
    print(f"second writer refused: {errors[0]}")



def _take_lock_on_each_rank(rank: int, world_size: int, saves: list) -> list:
    verdicts = []
    for save in saves:
        try:
            with hold_save_lock(save):
                verdicts.append("held")
        except ValueError as err:
            verdicts.append(str(err))
    return verdicts


@pytest.mark.slow  # two spawned ranks: about 20 s, over 60 s on a busy box
def test_every_rank_hears_rank_0s_verdict(tmp_path):
    """A held directory and an unusable one: rank 1 raises rank 0's one line too (and no
    rank is left waiting in a collective); a free one is held."""
    save = tmp_path / "ck"
    holder = hold_in_another_process(save)
    (tmp_path / "a_file").write_text("")
    paths = [str(save), str(tmp_path / "a_file" / "ck"), str(tmp_path / "free")]
    try:
        per_rank = run_distributed(_take_lock_on_each_rank, 2, timeout_s=300, args=(paths,))
    finally:
        holder.kill()
        holder.wait()
    assert per_rank[0] == per_rank[1]
    held, unusable, free = per_rank[0]
    assert f"PID {holder.pid}" in held and "is in use by another training" in held
    assert unusable == (f"--save: cannot take the lock {tmp_path}/a_file/ck/{LOCK_NAME} "
                        "(Not a directory). Fix: pass a --save directory this job can write")
    assert free == "held" and not (tmp_path / "free" / LOCK_NAME).exists()
