"""The test suite's name for the local-ranks launcher (megatron_mvmoe.launch.local_ranks):
`run_distributed(fn, world_size, timeout_s=...)` runs fn on gloo ranks and fails instead of
hanging; a failing rank raises `DistributedTestError`."""

from megatron_mvmoe.launch.local_ranks import LocalRanksError as DistributedTestError
from megatron_mvmoe.launch.local_ranks import free_port, run_distributed

__all__ = ["DistributedTestError", "free_port", "run_distributed"]
