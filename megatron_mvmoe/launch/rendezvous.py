"""Who am I in the job, and where is rank 0? Read from the launcher's environment.

Design choices:
- One `Rendezvous` value for every launcher (torchrun, Slurm srun, mpirun, a plain
  `python` run), so `init_distributed` and the trainer never branch on the launcher.
- Precedence: torchrun if RANK is set (torchrun started under srun still wins, since
  its per-process RANK is the truth), else Slurm if SLURM_PROCID is set, else MPI
  if an MPI rank variable is set, else a single process.
- Parsing is a pure function of a mapping (default os.environ) so every launcher is
  unit-tested with a dict; the one collective (MPI address broadcast) is injected.
- Errors are ValueErrors that name the environment variable and say what to fix.
- Slurm's rendezvous host is MASTER_ADDR, else the first node's name when it resolves,
  else that node's NodeAddr from `scontrol show node` (names need not be in DNS).
- Slurm's rendezvous port is MASTER_PORT when set, else derived from SLURM_JOB_ID
  (every task of a job derives the same one without talking to each other).

CLI: `python -m megatron_mvmoe.launch [--json | --field master_addr]` prints what this
process would use; `--field slurm_master` works in an sbatch script before srun.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import asdict, dataclass
from typing import Callable, Dict, Literal, Mapping, Optional, Sequence, Tuple

from megatron_mvmoe.launch.hostlist import expand_hostlist, expand_tasks_per_node
from megatron_mvmoe.launch.mpi import MpiWorld, pick_free_port

Launcher = Literal["torchrun", "slurm", "mpi", "single"]
LAUNCHERS = ("torchrun", "slurm", "mpi", "single")

SLURM_PORT_BASE = 20000
"""Slurm ports derived from the job id fall in [SLURM_PORT_BASE, SLURM_PORT_BASE + SLURM_PORT_SPAN)."""
SLURM_PORT_SPAN = 20000

MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "MV2_COMM_WORLD_RANK")
MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
MPI_LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")
MPI_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "MV2_COMM_WORLD_LOCAL_SIZE")


@dataclass(frozen=True)
class Rendezvous:
    """This process's place in the job and the address every rank meets at."""

    rank: int
    """Global rank, 0 <= rank < world_size."""

    world_size: int
    """Number of processes in the job."""

    local_rank: int
    """Rank among the processes on this node (selects the accelerator)."""

    local_world_size: int
    """Number of processes on this node."""

    master_addr: str
    """Host (name or IP) where rank 0 serves the TCP rendezvous store."""

    master_port: int
    """TCP port of the rendezvous store on master_addr."""

    launcher: Launcher
    """Which launcher's environment this was read from."""

    @property
    def init_method(self) -> str:
        """The torch.distributed init_method URL (IPv6 literals bracketed)."""
        host = f"[{self.master_addr}]" if ":" in self.master_addr else self.master_addr
        return f"tcp://{host}:{self.master_port}"

    def to_dict(self) -> Dict[str, object]:
        return asdict(self)


Env = Mapping[str, str]
Sources = Dict[str, str]  # field name -> the variable it was read from, for error messages


def _first(env: Env, names: Sequence[str]) -> Optional[Tuple[str, str]]:
    """(name, value) of the first variable in names that is set and non-empty."""
    for name in names:
        if env.get(name, "").strip():
            return name, env[name].strip()
    return None


def _as_int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer; fix the launcher environment") from None


def _read_int(env: Env, names: Sequence[str], field: str, sources: Sources) -> Optional[int]:
    found = _first(env, names)
    if found is None:
        return None
    sources[field] = found[0]
    return _as_int(*found)


def _require_int(env: Env, names: Sequence[str], field: str, sources: Sources, launcher: str) -> int:
    value = _read_int(env, names, field, sources)
    if value is None:
        raise ValueError(
            f"{launcher} launch: {' or '.join(names)} is not set; it gives the {field}. "
            f"Fix: launch with {launcher} as documented, or export the variable"
        )
    return value


def _validate(rdzv: Rendezvous, sources: Sources) -> Rendezvous:
    """Check cross-field consistency, naming the variables that disagree."""

    def name(field: str) -> str:
        return sources.get(field, field)

    if rdzv.world_size < 1:
        raise ValueError(f"{name('world_size')}={rdzv.world_size} must be >= 1")
    if not 0 <= rdzv.rank < rdzv.world_size:
        raise ValueError(
            f"{name('rank')}={rdzv.rank} is not in [0, {name('world_size')}={rdzv.world_size}); "
            "the launcher environment is inconsistent"
        )
    if not 1 <= rdzv.local_world_size <= rdzv.world_size:
        raise ValueError(
            f"{name('local_world_size')}={rdzv.local_world_size} must be in "
            f"[1, {name('world_size')}={rdzv.world_size}]"
        )
    if not 0 <= rdzv.local_rank < rdzv.local_world_size:
        raise ValueError(
            f"{name('local_rank')}={rdzv.local_rank} is not in "
            f"[0, {name('local_world_size')}={rdzv.local_world_size})"
        )
    if not rdzv.master_addr:
        raise ValueError(f"{name('master_addr')} is empty; set MASTER_ADDR to rank 0's host")
    if not 1 <= rdzv.master_port <= 65535:
        raise ValueError(f"{name('master_port')}={rdzv.master_port} is not a TCP port (1..65535)")
    return rdzv


def _from_torchrun(env: Env) -> Rendezvous:
    """torchrun (or a hand-made RANK/WORLD_SIZE env): LOCAL_* default to a one-node job."""
    src: Sources = {}
    rank = _require_int(env, ["RANK"], "rank", src, "torchrun")
    world = _require_int(env, ["WORLD_SIZE"], "world_size", src, "torchrun")
    local_rank = _read_int(env, ["LOCAL_RANK"], "local_rank", src)
    local_world = _read_int(env, ["LOCAL_WORLD_SIZE"], "local_world_size", src)
    addr = _first(env, ["MASTER_ADDR"])
    if addr is None:
        raise ValueError("torchrun launch: RANK is set but MASTER_ADDR is not; export MASTER_ADDR")
    port = _require_int(env, ["MASTER_PORT"], "master_port", src, "torchrun")
    src["master_addr"] = "MASTER_ADDR"
    return _validate(
        Rendezvous(rank, world, rank if local_rank is None else local_rank,
                   world if local_world is None else local_world, addr[1], port, "torchrun"),
        src,
    )


HostLookup = Callable[[str], Optional[str]]
"""Node name -> an address this process can connect to, or None when nothing resolves it."""


def _resolves(name: str) -> bool:
    try:
        socket.getaddrinfo(name, None)
        return True
    except (socket.gaierror, UnicodeError):
        return False


def scontrol_node_addr(name: str) -> Optional[str]:
    """NodeAddr of `name` as Slurm knows it (`scontrol show node`), or None."""
    if shutil.which("scontrol") is None:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "node", name, "--oneliner"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"\bNodeAddr=(\S+)", out.stdout) if out.returncode == 0 else None
    return found.group(1) if found else None


def slurm_node_address(name: str) -> Optional[str]:
    """The name itself when it resolves here; else Slurm's NodeAddr for it (clusters whose
    node names are not in DNS or /etc/hosts); else None. Only unresolvable names cost a
    slurmctld query, so large jobs do not flood the controller."""
    return name if _resolves(name) else scontrol_node_addr(name)


def slurm_master(env: Env, host_lookup: Optional[HostLookup] = None) -> Tuple[str, int]:
    """Rank 0's host (first node of the step/job) and the job's rendezvous port.

    Also usable in the batch script itself, before srun (see the sbatch examples).
    """
    addr = _first(env, ["MASTER_ADDR"])
    if addr is None:
        nodes = _first(env, ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"])
        if nodes is None:
            raise ValueError(
                "Slurm launch: neither MASTER_ADDR nor SLURM_JOB_NODELIST/SLURM_NODELIST is set; "
                "run under srun/sbatch or export MASTER_ADDR"
            )
        first = expand_hostlist(nodes[1])[0]
        found = (host_lookup or slurm_node_address)(first)
        if found is None:
            raise ValueError(
                f"Slurm launch: rank 0's node {first!r} (first of {nodes[0]}) does not resolve "
                f"here and `scontrol show node {first}` gave no NodeAddr. Fix: export "
                f"MASTER_ADDR=<address of {first}> to every task")
        addr = (nodes[0], found)
    port = _first(env, ["MASTER_PORT"])
    if port is not None:
        return addr[1], _as_int(*port)
    job = _first(env, ["SLURM_JOB_ID", "SLURM_JOBID"])
    if job is None:
        raise ValueError("Slurm launch: neither MASTER_PORT nor SLURM_JOB_ID is set; export MASTER_PORT")
    return addr[1], SLURM_PORT_BASE + _as_int(*job) % SLURM_PORT_SPAN


def _per_node_count(env: Env, name: str, value: str, src: Sources) -> int:
    """This node's entry of a tasks-per-node list such as '2(x3),1'."""
    counts = expand_tasks_per_node(value)
    node_id = _read_int(env, ["SLURM_NODEID"], "node_id", {}) or 0
    if node_id >= len(counts):
        raise ValueError(f"SLURM_NODEID={node_id} but {name}={value!r} lists {len(counts)} nodes")
    src["local_world_size"] = name
    return counts[node_id]


def _slurm_local_world(env: Env, src: Sources) -> int:
    """Tasks on this node: the step's own count (srun sets it), else the job's."""
    step = _first(env, ["SLURM_STEP_TASKS_PER_NODE"])
    if step is not None:
        return _per_node_count(env, *step, src)
    fixed = _read_int(env, ["SLURM_NTASKS_PER_NODE"], "local_world_size", src)
    if fixed is not None:
        return fixed
    job = _first(env, ["SLURM_TASKS_PER_NODE"])
    if job is None:
        raise ValueError(
            "Slurm launch: SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE not set; run the task with srun"
        )
    return _per_node_count(env, *job, src)


def _check_not_batch_script(env: Env, world: int) -> None:
    """The sbatch batch script itself also sees SLURM_PROCID=0 and the job's
    SLURM_NTASKS, but it is one process: starting there would wait for ranks that never
    come. Only srun tasks carry a step id."""
    if world > 1 and _first(env, ["SLURM_STEP_ID", "SLURM_STEPID"]) is None:
        raise ValueError(
            f"Slurm launch: SLURM_NTASKS={world} but SLURM_STEP_ID is not set, so this is the "
            "sbatch batch script, not a task. Fix: start the program with `srun` (one task per "
            "rank) or `srun torchrun ...` (one task per node)"
        )


def _from_slurm(env: Env, host_lookup: Optional[HostLookup]) -> Rendezvous:
    src: Sources = {}
    rank = _require_int(env, ["SLURM_PROCID"], "rank", src, "Slurm")
    world = _require_int(env, ["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"],
                         "world_size", src, "Slurm")
    _check_not_batch_script(env, world)
    local_rank = _require_int(env, ["SLURM_LOCALID"], "local_rank", src, "Slurm")
    local_world = _slurm_local_world(env, src)
    addr, port = slurm_master(env, host_lookup)
    src.update(master_addr="SLURM_JOB_NODELIST/MASTER_ADDR", master_port="MASTER_PORT/SLURM_JOB_ID")
    return _validate(Rendezvous(rank, world, local_rank, local_world, addr, port, "slurm"), src)


def _mpi4py_world() -> MpiWorld:
    from megatron_mvmoe.launch.mpi import mpi4py_world

    return mpi4py_world()


def _from_mpi(env: Env, mpi_world: Callable[[], MpiWorld]) -> Rendezvous:
    """mpirun: ranks from the environment; what is missing comes from one MPI collective."""
    src: Sources = {}
    rank = _require_int(env, MPI_RANK_VARS, "rank", src, "MPI")
    world = _read_int(env, MPI_SIZE_VARS, "world_size", src)
    local_rank = _read_int(env, MPI_LOCAL_RANK_VARS, "local_rank", src)
    local_world = _read_int(env, MPI_LOCAL_SIZE_VARS, "local_world_size", src)
    addr = _first(env, ["MASTER_ADDR"])
    port = _read_int(env, ["MASTER_PORT"], "master_port", src)
    if None in (world, local_rank, local_world, addr, port):
        try:
            info = mpi_world()
        except ImportError:
            raise ValueError(
                "MPI launch: rank 0's address is unknown. Fix: pip install mpi4py (extra 'mpi'), "
                "or export MASTER_ADDR and MASTER_PORT to every rank (mpirun -x)"
            ) from None
        world = info.world_size if world is None else world
        local_rank = info.local_rank if local_rank is None else local_rank
        local_world = info.local_world_size if local_world is None else local_world
        addr = addr or ("mpi4py", info.master_addr)
        port = info.master_port if port is None else port
    return _validate(Rendezvous(rank, world, local_rank, local_world, addr[1], port, "mpi"), src)


def _single(env: Env) -> Rendezvous:
    """A plain `python script.py`: rank 0 of 1, on loopback with a free port."""
    addr = _first(env, ["MASTER_ADDR"])
    port = _first(env, ["MASTER_PORT"])
    return Rendezvous(
        0, 1, 0, 1,
        addr[1] if addr else "127.0.0.1",
        _as_int(*port) if port else pick_free_port("127.0.0.1"),
        "single",
    )


def detect_launcher(env: Env) -> Launcher:
    """Which launcher started this process (see the precedence in the module docstring)."""
    if env.get("RANK", "").strip():
        return "torchrun"
    if env.get("SLURM_PROCID", "").strip():
        return "slurm"
    if _first(env, MPI_RANK_VARS) is not None:
        return "mpi"
    return "single"


def rendezvous_from_env(
    env: Optional[Env] = None, mpi_world: Callable[[], MpiWorld] = _mpi4py_world,
    host_lookup: Optional[HostLookup] = None,
) -> Rendezvous:
    """Read this process's Rendezvous from the launcher's environment.

    env defaults to os.environ. mpi_world is the collective used only for an MPI launch
    without MASTER_ADDR/MASTER_PORT (all ranks call it); tests inject a fake. host_lookup
    turns Slurm's first node name into an address (name, else NodeAddr from scontrol).
    """
    env = os.environ if env is None else env
    launcher = detect_launcher(env)
    if launcher == "torchrun":
        return _from_torchrun(env)
    if launcher == "slurm":
        return _from_slurm(env, host_lookup)
    if launcher == "mpi":
        return _from_mpi(env, mpi_world)
    return _single(env)
