"""rendezvous_from_env for each launcher, the precedence between them, and the
errors a broken environment must produce (naming the variable)."""

import pytest

from megatron_mvmoe.launch.mpi import MpiWorld
from megatron_mvmoe.launch.rendezvous import (
    SLURM_PORT_BASE,
    SLURM_PORT_SPAN,
    Rendezvous,
    slurm_node_address,
    detect_launcher,
    rendezvous_from_env,
)

TORCHRUN = {
    "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "node01", "MASTER_PORT": "29500",
}
SLURM = {
    "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
    "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_JOB_NODELIST": "gpu[07-09,12]", "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
}
OMPI = {
    "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}


def no_mpi():
    raise AssertionError("the MPI collective must not be called when the env is complete")


def fake_world():
    return MpiWorld(world_size=4, local_rank=0, local_world_size=2, master_addr="head", master_port=31000)


def test_torchrun():
    assert rendezvous_from_env(TORCHRUN) == Rendezvous(3, 8, 1, 2, "node01", 29500, "torchrun")


def test_torchrun_hand_made_env_defaults_to_one_node():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    r = rendezvous_from_env(env)
    assert (r.local_rank, r.local_world_size) == (1, 2)


REAL_LOOKUP = slurm_node_address


@pytest.fixture(autouse=True)
def node_names_resolve(monkeypatch):
    """The fake node names here (gpu07, vm) stand for names that resolve on a cluster."""
    from megatron_mvmoe.launch import rendezvous

    monkeypatch.setattr(rendezvous, "slurm_node_address", lambda name: name)


def test_unresolvable_node_name_uses_slurm_node_addr_or_says_what_to_set(monkeypatch):
    from megatron_mvmoe.launch import rendezvous

    asked = []
    monkeypatch.setattr(rendezvous, "_resolves", lambda name: False)
    monkeypatch.setattr(rendezvous, "scontrol_node_addr",
                        lambda name: asked.append(name) or "10.1.2.3")
    monkeypatch.setattr(rendezvous, "slurm_node_address", REAL_LOOKUP)
    assert rendezvous_from_env(SLURM).master_addr == "10.1.2.3" and asked == ["gpu07"]
    monkeypatch.setattr(rendezvous, "scontrol_node_addr", lambda name: None)
    with pytest.raises(ValueError, match=r"^Slurm launch: rank 0's node 'gpu07' \(first of "
                       r"SLURM_JOB_NODELIST\) does not resolve here and `scontrol show node "
                       r"gpu07` gave no NodeAddr\. Fix: export MASTER_ADDR="):
        rendezvous_from_env(SLURM)


def test_slurm_master_is_first_host_and_port_from_job_id():
    r = rendezvous_from_env(SLURM)
    assert r == Rendezvous(5, 8, 1, 2, "gpu07", SLURM_PORT_BASE + 123456 % SLURM_PORT_SPAN, "slurm")
    # every task derives the same port without communicating
    assert rendezvous_from_env({**SLURM, "SLURM_PROCID": "0"}).master_port == r.master_port


def test_slurm_overrides_and_step_values():
    env = {**SLURM, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000",
           "SLURM_STEP_NODELIST": "gpu[08-09]", "SLURM_STEP_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "0"}
    r = rendezvous_from_env(env)
    assert (r.master_addr, r.master_port, r.local_world_size) == ("10.0.0.1", 4000, 3)
    del env["MASTER_ADDR"]
    assert rendezvous_from_env(env).master_addr == "gpu08"


def test_slurm_ntasks_per_node_and_legacy_names():
    env = {"SLURM_PROCID": "0", "SLURM_NPROCS": "4", "SLURM_LOCALID": "0", "SLURM_STEPID": "3",
           "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODELIST": "vm", "SLURM_JOBID": "7"}
    assert rendezvous_from_env(env) == Rendezvous(0, 4, 0, 4, "vm", SLURM_PORT_BASE + 7, "slurm")


def test_slurm_batch_script_is_refused_but_one_task_job_is_fine():
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    with pytest.raises(ValueError, match="sbatch batch script.*srun"):
        rendezvous_from_env(batch)
    one = {**batch, "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
           "SLURM_TASKS_PER_NODE": "1", "SLURM_NODEID": "0"}
    assert rendezvous_from_env(one).world_size == 1


def test_slurm_step_task_count_wins():
    r = rendezvous_from_env({**SLURM, "SLURM_STEP_NUM_TASKS": "6", "SLURM_PROCID": "5"})
    assert r.world_size == 6


def test_mpi_env_complete_needs_no_collective():
    env = {**OMPI, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}
    assert rendezvous_from_env(env, mpi_world=no_mpi) == Rendezvous(1, 2, 1, 2, "127.0.0.1", 29400, "mpi")


def test_mpi_address_comes_from_collective():
    assert rendezvous_from_env(OMPI, mpi_world=fake_world) == Rendezvous(1, 2, 1, 2, "head", 31000, "mpi")


def test_pmix_rank_only_takes_sizes_from_collective():
    r = rendezvous_from_env({"PMIX_RANK": "3"}, mpi_world=fake_world)
    assert r == Rendezvous(3, 4, 0, 2, "head", 31000, "mpi")


def test_mpich_hydra_vars():
    env = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
           "MASTER_ADDR": "h", "MASTER_PORT": "9"}
    assert rendezvous_from_env(env, mpi_world=no_mpi).launcher == "mpi"


def test_mpi_without_mpi4py_says_how_to_fix():
    def missing():
        raise ImportError("No module named 'mpi4py'")

    with pytest.raises(ValueError, match="mpi4py.*MASTER_ADDR"):
        rendezvous_from_env(OMPI, mpi_world=missing)


def test_single_process():
    r = rendezvous_from_env({})
    assert (r.rank, r.world_size, r.local_rank, r.local_world_size, r.launcher) == (0, 1, 0, 1, "single")
    assert r.master_addr == "127.0.0.1" and 0 < r.master_port < 65536
    assert r.init_method == f"tcp://127.0.0.1:{r.master_port}"


def test_ipv6_init_method_is_bracketed():
    assert Rendezvous(0, 1, 0, 1, "::1", 5, "single").init_method == "tcp://[::1]:5"


@pytest.mark.parametrize(
    "env,expected",
    [
        ({**SLURM, **OMPI, **TORCHRUN}, "torchrun"),  # torchrun under srun
        ({**SLURM, **OMPI}, "slurm"),  # srun --mpi=pmix also sets PMIx vars
        (OMPI, "mpi"),
        ({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "vm"}, "single"),  # salloc shell, no task
        ({}, "single"),
    ],
)
def test_precedence(env, expected):
    assert detect_launcher(env) == expected


@pytest.mark.parametrize(
    "env,message",
    [
        ({**TORCHRUN, "RANK": "8"}, r"RANK=8 is not in \[0, WORLD_SIZE=8\)"),
        ({**TORCHRUN, "LOCAL_RANK": "2"}, r"LOCAL_RANK=2 is not in \[0, LOCAL_WORLD_SIZE=2\)"),
        ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR"),
        ({k: v for k, v in TORCHRUN.items() if k != "WORLD_SIZE"}, "WORLD_SIZE is not set"),
        ({**TORCHRUN, "WORLD_SIZE": "eight"}, "WORLD_SIZE='eight' is not an integer"),
        ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
        ({**SLURM, "SLURM_PROCID": "8"}, r"SLURM_PROCID=8 is not in \[0, SLURM_NTASKS=8\)"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_NODELIST"}, "SLURM_JOB_NODELIST"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}, "MASTER_PORT nor SLURM_JOB_ID"),
        ({**SLURM, "SLURM_NODEID": "4"}, "SLURM_NODEID=4"),
        ({**SLURM, "SLURM_JOB_NODELIST": "gpu[07-"}, "unclosed"),
        ({**OMPI, "OMPI_COMM_WORLD_RANK": "2"}, r"OMPI_COMM_WORLD_RANK=2 is not in \[0, OMPI_COMM_WORLD_SIZE=2\)"),
    ],
)
def test_inconsistent_env_names_the_variable(env, message):
    with pytest.raises(ValueError, match=message):
        rendezvous_from_env(env, mpi_world=fake_world)


def test_device_index():
    from megatron_mvmoe.launch.init import device_index

    assert device_index(3, 8) == 3
    assert device_index(5, 1) == 0  # one GPU bound per task by the scheduler
    with pytest.raises(ValueError, match="local_rank=4 but this process sees 2 devices"):
        device_index(4, 2)
