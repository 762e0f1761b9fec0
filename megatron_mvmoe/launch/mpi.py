"""What an MPI launch cannot put in the environment: rank 0's address and a free port.

Design choices:
- mpirun sets ranks and sizes (OMPI_COMM_WORLD_*, PMI_*), but no rendezvous address
  for torch.distributed; rank 0 picks a free TCP port and broadcasts it with its
  host name over MPI, so every rank can reach the TCPStore rank 0 will serve.
- mpi4py is imported lazily (it is the optional `mpi` extra) and only when the
  environment lacks MASTER_ADDR/MASTER_PORT, so a plain `mpirun -x MASTER_ADDR ...`
  launch needs no mpi4py at all.
- The same call also reports world size and node-local rank/size from the MPI
  communicator, authoritative where the launcher's variables are incomplete
  (PMIx sets PMIX_RANK but no size variable).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class MpiWorld:
    """The MPI view of the job, as seen by one rank."""

    world_size: int
    """Size of MPI_COMM_WORLD."""

    local_rank: int
    """Rank inside this node's shared-memory communicator."""

    local_world_size: int
    """Size of this node's shared-memory communicator."""

    master_addr: str
    """Host name of MPI rank 0, broadcast to all ranks."""

    master_port: int
    """Free TCP port picked on rank 0, broadcast to all ranks."""


def pick_free_port(host: str = "") -> int:
    """Ask the OS for a free TCP port (bind to port 0). It can be taken again before
    use, but the window is milliseconds; good enough for a rendezvous port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def mpi4py_world() -> MpiWorld:
    """Collective over MPI_COMM_WORLD: every rank must call it (rank 0 broadcasts).

    Raises ImportError when mpi4py is not installed.
    """
    from mpi4py import MPI  # optional dependency: pip install -e .[mpi]

    comm = MPI.COMM_WORLD
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        address = (socket.gethostname(), pick_free_port()) if comm.Get_rank() == 0 else None
        master_addr, master_port = comm.bcast(address, root=0)
        return MpiWorld(
            world_size=comm.Get_size(),
            local_rank=node_comm.Get_rank(),
            local_world_size=node_comm.Get_size(),
            master_addr=master_addr,
            master_port=master_port,
        )
    finally:
        node_comm.Free()
