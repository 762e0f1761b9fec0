"""Run a function on N local gloo ranks in child processes, failing instead of hanging:
the launcher of the test suite and of the tools that run a few local ranks (a2a_volume's
counted collectives, the analysis tools' one-rank model runs, bench_moe_layer's port).

Design choices:
- `fork` start method by default: children inherit the already-imported torch and
  Megatron (seconds saved per rank on a 2-core machine); no CUDA is initialised in the
  parent on CPU, so forking is safe, unless torch.compile ran in the parent: the children
  would share its inductor compile workers and autograd threads and may hang, so whatever
  compiles (the inductor probe included) runs in a rank, never in the launching process
  (tests/layers/test_compiled_fusions.py fails a test that compiles in the pytest worker).
  `spawn` is available for CUDA.
- Every rank reports through a queue; the parent waits with one deadline for all. A rank
  that raises, dies (non-zero exit, killed) or a job that passes the deadline kills every
  rank and raises `LocalRanksError` with the failing rank's traceback.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue as queue_lib
import socket
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence


class LocalRanksError(RuntimeError):
    """A rank failed, died or the job timed out."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _to_bytes(obj: Any) -> bytes:
    """Results travel by value: tensors shared by file descriptor would vanish when the
    child exits before the parent reads them."""
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    import torch

    # Our own children's results (tensors, dicts, floats): trusted, not user files.
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(fn: Callable, rank: int, world_size: int, port: int, args: Sequence[Any],
            results: mp.Queue, timeout_s: float, backend: str = "gloo") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        from megatron_mvmoe import platform

        if backend == "nccl":  # one device per rank, bound before the group exists
            platform.set_local_device(rank)
        else:
            platform.apply_cpu_patches()
        platform.reset_megatron_process_state()
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}",
                                timeout=timedelta(seconds=timeout_s))
        result = fn(rank, world_size, *args)
        results.put(("ok", rank, _to_bytes(result)))
    except BaseException:  # report everything, including assertion failures
        results.put(("error", rank, traceback.format_exc()))
    finally:
        try:
            from megatron_mvmoe.parallel import destroy_layout

            destroy_layout()
        except Exception:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def _default_start_method() -> str:
    """fork, unless this process already holds a process group: a forked child would
    inherit its gloo threads and sockets and hang, so start fresh interpreters then."""
    import torch.distributed as dist

    return "spawn" if dist.is_available() and dist.is_initialized() else "fork"


def run_distributed(fn: Callable, world_size: int, timeout_s: float = 180.0,
                    args: Sequence[Any] = (), start_method: Optional[str] = None,
                    daemon: bool = True, backend: str = "gloo") -> List[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks (backend="nccl": one GPU
    each, fresh interpreters); return results by rank.

    `fn` must be a module-level function (picklable under `spawn`). `daemon=False` lets a
    rank start processes of its own (Megatron's async dist-checkpoint writer starts a
    multiprocessing Manager, which a daemonic process may not do). Raises
    LocalRanksError on an exception in any rank, a dead rank, or a timeout.
    """
    ctx = mp.get_context(start_method or ("spawn" if backend == "nccl"
                                          else _default_start_method()))
    results: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, daemon=daemon,
                         args=(fn, rank, world_size, port, args, results, timeout_s,
                               backend))
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, results, world_size, timeout_s)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=5)


def _collect(procs, results, world_size: int, timeout_s: float) -> List[Any]:
    deadline = time.monotonic() + timeout_s
    outputs: List[Optional[Any]] = [None] * world_size
    reported = set()
    while len(reported) < world_size:
        if time.monotonic() > deadline:
            missing = sorted(set(range(world_size)) - reported)
            raise LocalRanksError(
                f"distributed job timed out after {timeout_s:.0f}s; ranks {missing} never "
                f"finished (deadlock or a hung collective)")
        try:
            status, rank, payload = results.get(timeout=0.5)
        except queue_lib.Empty:
            _raise_if_dead(procs, reported)
            continue
        if status == "error":
            _raise_first_failure(procs, results, reported, [(rank, payload)])
        outputs[rank] = _from_bytes(payload)
        reported.add(rank)
    return outputs


def _raise_first_failure(procs, results, reported, errors) -> None:
    """Report every rank's failure: the root cause (a peer that raised or died first) is
    often not the first message to arrive, e.g. rank 0's 'connection reset' may beat rank
    1's own exception through the queue."""
    time.sleep(1.0)
    while True:
        try:
            status, rank, payload = results.get(timeout=0.2)
        except queue_lib.Empty:
            break
        if status == "error":
            errors.append((rank, payload))
    _raise_if_dead(procs, reported | {rank for rank, _ in errors})
    raise LocalRanksError("\n".join(f"rank {rank} failed:\n{payload}"
                                         for rank, payload in sorted(errors)))


def _raise_if_dead(procs, reported) -> None:
    for rank, proc in enumerate(procs):
        # exit code 0 without a report means the message is still in the queue: wait.
        if rank not in reported and proc.exitcode not in (None, 0):
            raise LocalRanksError(
                f"rank {rank} died with exit code {proc.exitcode} before reporting")
