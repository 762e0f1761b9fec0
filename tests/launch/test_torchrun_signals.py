"""examples/launch/torchrun_local.sh (the README's launch line) under a signal to its whole
process group, as a shell's `kill -USR1 -- -<pgid>` or a scheduler sends it: the workers
(torchrun puts each in its own session) must get it, save at that step and exit, the
launcher must exit 3 (stopped early, saved) with one last line saying so, no worker may be
left running, and the resumed run's per-step losses must equal an uninterrupted run's.
Before the fix, SIGUSR1 killed torchrun's agent (status 138) and the workers trained on as
orphans, saving nothing.

Plain `torchrun` (the docs' launch line, no wrapper) under the same signal: its agent dies
of SIGUSR1 at once, and the workers, re-parented, notice at the next step (stopping.py),
save and exit; none is left running and the resume is exact. Before the fix they trained on
to the end and never saved at the signal."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.launchers, pytest.mark.slow, pytest.mark.timeout(900)]
SCRIPT = REPO / "examples" / "launch" / "torchrun_local.sh"
PACED_JOB = REPO / "tests" / "launch" / "paced_job.py"
STEPS = 16


def run_yaml(folder: Path, tokens: str, timeout_s: float = 30, ep: int = 2) -> str:
    """The tiny EP=2 model of the fault-tolerance tests, saving only when stopped."""
    raw = dict(model=dict(preset="tiny_smoe", vocab_size=512, seq_length=32),
               parallel=dict(ep=ep, distributed_timeout_seconds=timeout_s),
               data=dict(kind="tokens", path=tokens),
               optimizer=dict(lr=3e-3, min_lr=3e-4, warmup_iters=1),
               training=dict(train_iters=STEPS, global_batch_size=8, micro_batch_size=2,
                             eval_interval=0, eval_iters=0, save_interval=10_000),
               logging=dict(log_interval=1, tensorboard=False, routing_metrics=False))
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def launch(program, out: Path, **env_vars) -> subprocess.Popen:
    """torchrun_local.sh in a new session (its pgid is its pid), output to `out`."""
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", NPROC="2", **env_vars)
    with open(out, "w") as fh:
        return subprocess.Popen([str(SCRIPT), *map(str, program)], stdout=fh,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)


def launch_plain_torchrun(program, out: Path, **env_vars) -> subprocess.Popen:
    """`torchrun --standalone --nproc-per-node 2 <program>` in a new session, no wrapper."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **env_vars)
    with open(out, "w") as fh:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node", "2", *map(str, program)], stdout=fh,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                cwd=REPO)


def wait_until_gone(needle: str, timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    while processes_mentioning(needle) and time.monotonic() < deadline:
        time.sleep(0.5)
    return processes_mentioning(needle)


def finish(proc: subprocess.Popen, timeout_s: float = 300) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def wait_for(path: Path, pattern: str, timeout_s: float) -> str:
    deadline, text = time.monotonic() + timeout_s, ""
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if re.search(pattern, text):
            return text
        time.sleep(0.2)
    pytest.fail(f"no {pattern!r} in {path} after {timeout_s} s:\n{text[-3000:]}")


def losses(run_dir: Path) -> dict:
    """step -> loss from metrics.jsonl (a resume appends: the last record of a step wins)."""
    found = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind", "train") == "train" and "loss" in record:
            found[record["step"]] = record["loss"]
    return found


def processes_mentioning(needle: str) -> list:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if needle in cmd:
            found.append((int(pid), cmd))
    return found


def trainer(config: str, save: Path, run_dir: Path, *extra) -> list:
    return ["-m", "megatron_mvmoe.training.pretrain", "--config", config, "--save", save,
            "--run-dir", run_dir, *extra]


def resume_exactly(config, save: Path, run_dir: Path, step: int, expected: dict, out: Path):
    """Resume from iter_<step> through torchrun_local.sh; every loss equals the reference."""
    status = finish(launch(trainer(config, save, run_dir, "--load", save), out))
    text = out.read_text(errors="replace")
    assert status == 0 and f"resumed from {save}/iter_{step:07d} at step {step}" in text, \
        text[-3000:]
    assert losses(run_dir) == expected


@pytest.fixture(scope="module")
def reference(tmp_path_factory, text_tokens):
    """Per-step losses of the same run, uninterrupted, through the same launcher."""
    folder = tmp_path_factory.mktemp("reference")
    config, out = run_yaml(folder, text_tokens), folder / "out.txt"
    status = finish(launch(trainer(config, folder / "ck", folder / "run"), out))
    assert status == 0, out.read_text()[-3000:]
    found = losses(folder / "run")
    assert sorted(found) == list(range(1, STEPS + 1))
    return config, found


def stop_with(signum, config, save: Path, run_dir: Path, after_step: int, out: Path,
              *extra) -> int:
    """Launch (resuming with extra = --load), send `signum` to the launcher's group two
    steps after `after_step`: the launcher exits 3 having saved, naming the signal last,
    and leaves no process behind. Returns the step saved at."""
    proc = launch([PACED_JOB, *trainer(config, save, run_dir, *extra)[2:]], out)
    try:
        wait_for(out, rf"step +{after_step + 2}/", 240)
        os.killpg(proc.pid, signum)
    finally:
        status = finish(proc, 120)
    text = out.read_text(errors="replace")
    name = signal.Signals(signum).name
    stop = re.search(rf"stopping after step (\d+): {name} received", text)
    assert status == 3 and stop, (status, text[-3000:])
    step = int(stop.group(1))
    assert step < STEPS and f"saved checkpoint {save}/iter_{step:07d}" in text
    assert (save / f"iter_{step:07d}" / "run_state.json").exists()
    last = text.splitlines()[-1]
    assert f"stopped early ({name} received) at step {step}" in last, text[-2000:]
    time.sleep(1)
    assert processes_mentioning(str(save)) == []  # no worker (or agent) left behind
    return step


def test_usr1_then_term_to_the_launcher_group_each_save_and_the_resume_is_exact(tmp_path,
                                                                                 reference):
    """One chain (a launch per signal costs ~16 s in CI): USR1 stops the first launch, TERM
    the run resumed from its save; the last resume's per-step losses equal the
    uninterrupted run's."""
    config, expected = reference
    save, run_dir = tmp_path / "ck", tmp_path / "run"
    by_usr1 = stop_with(signal.SIGUSR1, config, save, run_dir, 0, tmp_path / "usr1.txt")
    by_term = stop_with(signal.SIGTERM, config, save, run_dir, by_usr1, tmp_path / "term.txt",
                        "--load", save)
    resumed = (tmp_path / "term.txt").read_text(errors="replace")
    assert f"resumed from {save}/iter_{by_usr1:07d} at step {by_usr1}" in resumed, \
        resumed[-3000:]
    resume_exactly(config, save, run_dir, by_term, expected, tmp_path / "resumed.txt")
    print(f"USR1: stopped and saved at step {by_usr1}; resumed, TERM: saved at step "
          f"{by_term}; resumed to {STEPS}: all {STEPS} losses equal the uninterrupted run's")


def test_usr1_to_a_plain_torchrun_group_saves_and_leaves_no_orphan(tmp_path, reference):
    config, expected = reference
    save, run_dir, out = tmp_path / "ck", tmp_path / "run", tmp_path / "out.txt"
    proc = launch_plain_torchrun([PACED_JOB, *trainer(config, save, run_dir)[2:]], out)
    try:
        wait_for(out, r"step +2/", 240)
        os.killpg(proc.pid, signal.SIGUSR1)
        assert proc.wait(timeout=30) == -signal.SIGUSR1  # the agent dies of it, as before
        left = wait_until_gone(str(save), 120)
    finally:
        for pid, _ in processes_mentioning(str(save)):
            os.kill(pid, signal.SIGKILL)
    text = out.read_text(errors="replace")
    assert left == [], text[-3000:]  # every worker exited by itself
    stop = re.search(r"stopping after step (\d+): the launcher exited", text)
    assert stop, text[-3000:]
    step = int(stop.group(1))
    assert step < STEPS and f"saved checkpoint {save}/iter_{step:07d}" in text, text[-3000:]
    assert (save / "latest").read_text().strip() == f"iter_{step:07d}"

    resume_exactly(config, save, run_dir, step, expected, tmp_path / "resumed.txt")
    print(f"plain torchrun, USR1 to its group: workers saved at step {step} and exited; "
          f"resumed to {STEPS}: all losses equal the uninterrupted run's")
