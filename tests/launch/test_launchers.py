"""Real 2-process jobs under each launcher, running tools/launch_check.py through the
recipes in examples/: torchrun, mpirun, and sbatch on a local one-node Slurm cluster
(started and stopped by tools/slurm_local.py). Each rank must report the same
rendezvous, a correct all_reduce and working Megatron process groups.

Every subprocess has a timeout so a hung rendezvous fails the test instead of the run.
The timeouts are generous because the CI machine's 2 cores are shared.
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 300
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMIX_", "PMI_", "MV2_")

pytestmark = pytest.mark.launchers


def clean_env(**extra) -> dict:
    """This interpreter first on PATH, and no launcher variables leaking in from outside
    (pytest itself might run under srun or torchrun)."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable, REPO=str(REPO),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env.update(extra)
    return env


def run(cmd, env, timeout_s=LAUNCH_TIMEOUT_S) -> str:
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def rank_reports(stdout: str) -> list:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def check_two_rank_job(reports: list, launcher: str) -> None:
    assert sorted(r["rank"] for r in reports) == [0, 1], reports
    assert {r["launcher"] for r in reports} == {launcher}
    assert {r["world_size"] for r in reports} == {2}
    assert sorted(r["local_rank"] for r in reports) == [0, 1]
    assert len({(r["master_addr"], r["master_port"]) for r in reports}) == 1, "ranks met at different addresses"
    assert all(r["allreduce_ok"] for r in reports)
    assert all(r["layout_ok"] and r["group_sizes"]["ep"] == 2 for r in reports)


def test_torchrun_two_processes():
    """torchrun --nproc_per_node 2 tools/launch_check.py (examples/launch/torchrun_local.sh)."""
    out = run(["bash", "examples/launch/torchrun_local.sh"], clean_env(NPROC="2"))
    check_two_rank_job(rank_reports(out), "torchrun")


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (apt-get install openmpi-bin)")
def test_mpirun_two_processes():
    """mpirun ... -np 2 python tools/launch_check.py (examples/launch/mpirun_local.sh);
    rank 0's address and port travel over MPI (mpi4py)."""
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install -e .[mpi])")
    out = run(["bash", "examples/launch/mpirun_local.sh"], clean_env(NPROC="2"))
    check_two_rank_job(rank_reports(out), "mpi")


# ------------------------------------------------------------------------- Slurm
SLURM_TOOLS = ("sbatch", "scontrol", "slurmctld", "slurmd", "munged")
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def slurm_local(command: str) -> dict:
    out = subprocess.run([sys.executable, "tools/slurm_local.py", command, "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    result = json.loads(out.stdout)
    assert out.returncode == 0, f"slurm_local {command} failed: {result.get('error')}\n{out.stderr}"
    return result


@pytest.fixture(scope="module")
def slurm_cluster():
    """A one-node cluster for this module; stopped (by PID) only if this fixture started it."""
    missing = [t for t in SLURM_TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"Slurm not installed ({', '.join(missing)}): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm cluster needs root")
    cluster = slurm_local("start")
    yield cluster
    if not cluster["already_running"]:
        slurm_local("stop")


def job_state(job_id: str, env: dict) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env,
                         capture_output=True, text=True, timeout=30).stdout
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    return fields.get("JobState", "UNKNOWN")


def wait_for_job(job_id: str, env: dict, timeout_s: float) -> str:
    """Poll (sbatch --wait polls too slowly for a 10 s job); cancel on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = job_state(job_id, env)
        if state in FINAL_STATES:
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], env=env, timeout=30)
    pytest.fail(f"Slurm job {job_id} still {job_state(job_id, env)} after {timeout_s} s; cancelled")


def test_sbatch_two_tasks(slurm_cluster, tmp_path):
    """sbatch examples/slurm/local_cpu_smoke.sbatch: srun 2 tasks, rendezvous from SLURM_*."""
    env = clean_env(**slurm_cluster["env"])
    log = tmp_path / "smoke.out"
    job_id = run(["sbatch", "--parsable", f"--output={log}", "examples/slurm/local_cpu_smoke.sbatch"],
                 env, timeout_s=60).strip().split(";")[0]
    state = wait_for_job(job_id, env, LAUNCH_TIMEOUT_S)
    text = log.read_text() if log.exists() else "(no output file)"
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{text[-3000:]}"
    check_two_rank_job(rank_reports(text), "slurm")


def test_slurm_local_start_is_idempotent(slurm_cluster):
    again = slurm_local("start")
    assert again["already_running"] and again["pids"] == slurm_cluster["pids"]
    assert again["node_state"] in ("idle", "mixed", "allocated")


def test_sbatch_two_tasks_train_and_checkpoint(slurm_cluster, tmp_path, text_tokens):
    """sbatch examples/slurm/train_cpu_smoke.sbatch: the trainer itself on 2 srun tasks
    (EP=2, rendezvous from SLURM_*) trains 4 steps on real text and checkpoints."""
    tokens = text_tokens
    ckpt, run_dir, log = tmp_path / "ckpt", tmp_path / "run", tmp_path / "train.out"
    env = clean_env(**slurm_cluster["env"])
    job_id = run(["sbatch", "--parsable", f"--output={log}", "examples/slurm/train_cpu_smoke.sbatch",
                  "--data-kind", "tokens", "--data-path", tokens, "--vocab-size", "512",
                  "--seq-length", "32", "--train-iters", "4", "--global-batch-size", "8",
                  "--micro-batch-size", "2", "--eval-iters", "1", "--eval-interval", "0",
                  "--save", str(ckpt), "--save-interval", "2", "--run-dir", str(run_dir),
                  "--tensorboard", "false", "--lr-warmup-iters", "1"],
                 env, timeout_s=60).strip().split(";")[0]
    state = wait_for_job(job_id, env, LAUNCH_TIMEOUT_S)
    text = log.read_text() if log.exists() else "(no output file)"
    assert state == "COMPLETED", f"job {job_id} ended {state}:\n{text[-3000:]}"
    assert (ckpt / "latest").read_text().strip() == "iter_0000004", text[-2000:]
    assert (ckpt / "iter_0000002").is_dir()
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any(s.get("step") == 4 for s in steps), steps[-3:]
