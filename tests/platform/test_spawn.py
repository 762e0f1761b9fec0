"""The test spawner fails (never hangs) on an exception, a dead rank or a deadlock."""

import os

import pytest
import torch.distributed as dist

from megatron_mvmoe.testing.spawn import DistributedTestError, run_distributed


def _allreduce(rank, world_size):
    import torch

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()


def _die_on_rank1(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def _deadlock(rank, world_size):
    if rank == 0:
        dist.barrier()


def test_results_come_back_by_rank():
    assert run_distributed(_allreduce, 2, timeout_s=60) == [3.0, 3.0]


def test_exception_fails_with_traceback():
    with pytest.raises(DistributedTestError, match="boom on rank 1"):
        run_distributed(_raise_on_rank1, 2, timeout_s=30)


def test_dead_rank_fails():
    with pytest.raises(DistributedTestError, match="rank 1 died with exit code 3"):
        run_distributed(_die_on_rank1, 2, timeout_s=30)


def test_deadlock_times_out():
    with pytest.raises(DistributedTestError, match="timed out|failed"):
        run_distributed(_deadlock, 2, timeout_s=8)


def test_spawner_survives_a_process_group_in_the_parent():
    """A test that initialised gloo in the pytest process must not make later jobs hang."""
    from megatron_mvmoe.testing.spawn import free_port

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        assert run_distributed(_allreduce, 2, timeout_s=90) == [3.0, 3.0]
    finally:
        if own_group:
            dist.destroy_process_group()
