"""The dist-checkpointing write-results queue adapter: still needed by the pinned Megatron,
and a synchronous save's queue is in-process (no Manager process left behind)."""

import queue

from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_mvmoe.platform import dist_ckpt_writer_queue as writer_queue


def test_megatron_still_keeps_the_queue_as_module_state():
    assert writer_queue.still_needed()


def test_sync_save_queue_is_in_process_and_background_gets_megatrons():
    writer_queue.close_writer_processes()
    writer_queue.in_process_results()
    assert type(filesystem_async._results_queue) is queue.Queue  # no Manager process
    writer_queue.cross_process_results()
    assert filesystem_async._results_queue is None  # Megatron builds its Manager queue
    writer_queue.in_process_results()
    writer_queue.close_writer_processes()
    assert filesystem_async._results_queue is None
