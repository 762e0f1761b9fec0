"""Launch: read the launcher's environment (torchrun, Slurm, MPI, single) and start
torch.distributed from it. See rendezvous.py for the precedence rules."""

from megatron_mvmoe.launch.hostlist import expand_hostlist, expand_tasks_per_node
from megatron_mvmoe.launch.init import init_distributed
from megatron_mvmoe.launch.rendezvous import Rendezvous, detect_launcher, rendezvous_from_env

__all__ = [
    "Rendezvous",
    "detect_launcher",
    "expand_hostlist",
    "expand_tasks_per_node",
    "init_distributed",
    "rendezvous_from_env",
]
