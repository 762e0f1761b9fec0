"""The training loop's wall time, for benchmarks that compare runs side by side
(tools/bench_ckpt_save.py, tools/bench_a2a_metrics.py): a local-ranks worker."""

from __future__ import annotations

import copy
import time
from typing import Dict


def loop_seconds(rank: int, world_size: int, raw: Dict) -> float:
    """Train the raw run config; the loop's wall time from the first step's start to the
    return (start-up excluded), on every rank."""
    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training.pretrain import pretrain

    run = config_from_dict(copy.deepcopy(raw))
    pgs = initialize_layout(run.parallel.layout(),
                            timeout_s=run.parallel.distributed_timeout_seconds)
    marks = {}

    def on_step(step, trainer):
        marks.setdefault("start", time.perf_counter())
    pretrain(run, pgs, on_step=on_step)
    return time.perf_counter() - marks["start"]
