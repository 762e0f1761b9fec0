"""The write-results queue of Megatron's dist-checkpointing file writer, kept from outliving
the process (every platform, not only CPU).

Megatron's `filesystem_async` collects every writer's results through a module-level queue
that it creates on first use as `multiprocessing.Manager().Queue()`: a helper *process*
that outlives a rank killed by its launcher and holds the job's stdout open forever.

Design choices:
- A synchronous save hands the module a plain in-process queue first (`in_process_results`):
  its writers run in this process, so no Manager is started.
- A background save writes from a forked process, so its results must travel through
  Megatron's Manager queue: `cross_process_results` drops an in-process queue a sync save
  installed, and `close_writer_processes` shuts the Manager down at the end of a run.
- `still_needed` is the probe tests/platform runs: while Megatron keeps the queue as module
  state, this adapter applies; when it stops doing so, the probe fails and this module goes.
"""

from __future__ import annotations

import queue


def _filesystem_async():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return filesystem_async


def still_needed() -> bool:
    """True while Megatron's file writer keeps its results queue as module state."""
    module = _filesystem_async()
    return hasattr(module, "_results_queue") and hasattr(module, "get_write_results_queue")


def in_process_results() -> None:
    """Before a synchronous save: an in-process queue, so no Manager process starts."""
    module = _filesystem_async()
    if getattr(module, "_results_queue", None) is None:
        module._results_queue = queue.Queue()


def cross_process_results() -> None:
    """Before a background save: let Megatron build its Manager queue (forked writers)."""
    module = _filesystem_async()
    if isinstance(getattr(module, "_results_queue", None), queue.Queue):
        module._results_queue = None


def close_writer_processes() -> None:
    """Shut down the Manager process of a background save, if one was started."""
    module = _filesystem_async()
    manager = getattr(getattr(module, "_results_queue", None), "_manager", None)
    if manager is not None:
        manager.shutdown()
    module._results_queue = None
