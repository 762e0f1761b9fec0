"""The named checkpoint parts (training/checkpoint_parts.py): each part's state round-trips
against a naive reference (the values written out, the draws repeated), run_state.json is
exactly the historical key set (so older checkpoints keep loading), and a part missing from
run_state.json is one error naming the part and the fix. The model and optimizer parts are
exercised end to end by the resume tests (bit-identical continuation, resharding)."""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_mvmoe.checkpointing.directory import FORMAT
from megatron_mvmoe.checkpointing.errors import CheckpointError
from megatron_mvmoe.training.checkpoint_parts import (ResumeState, RngPart, RunMetadata,
                                                      SchedulerPart, read_part, run_state_of)

pytestmark = pytest.mark.timeout(60)

# The run_state.json keys every checkpoint since the format was fixed has carried, written
# out by hand: the parts must produce exactly these (no more, no fewer).
HISTORICAL_KEYS = {"format", "step", "consumed_samples", "gamma", "skipped_iters",
                   "world_size", "layout", "optimizer_format", "scheduler", "fingerprint",
                   "config"}


def _scheduler(max_lr=1e-3, steps=0):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=max_lr)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=max_lr, min_lr=1e-5, lr_warmup_steps=2,
        lr_decay_steps=10, lr_decay_style="cosine", start_wd=0.1, end_wd=0.1,
        wd_incr_steps=10, wd_incr_style="constant", override_opt_param_scheduler=False,
        use_checkpoint_opt_param_scheduler=True)
    for _ in range(steps):
        scheduler.step(increment=1)
    return scheduler, optimizer


TRAINING = SimpleNamespace(override_opt_param_scheduler=False,
                           use_checkpoint_opt_param_scheduler=True)


def _parts(step=7):
    position = ResumeState(step=step, consumed_samples=56, gamma=0.25, skipped_iters=1)
    metadata = RunMetadata(world_size=2, layout={"tp": 1, "pp": 2, "ep": 1, "etp": None,
                                                 "vpp": None},
                           optimizer_format="dp_reshardable", fingerprint={"hidden": 64},
                           config={"model": {"hidden_size": 64}})
    return [metadata, position, SchedulerPart(_scheduler(steps=step)[0], TRAINING)]


def test_run_state_is_the_historical_format():
    state = run_state_of(_parts())
    assert set(state) == HISTORICAL_KEYS
    assert (state["step"], state["consumed_samples"], state["gamma"],
            state["skipped_iters"]) == (7, 56, 0.25, 1)
    assert state["scheduler"]["num_steps"] == 7
    assert state["format"] == FORMAT and state["layout"]["pp"] == 2


def test_json_parts_round_trip():
    state = run_state_of(_parts())
    position, metadata = ResumeState(), RunMetadata()
    scheduler, optimizer = _scheduler()
    read_part(position, state, "ckpt")
    read_part(metadata, state, "ckpt")
    read_part(SchedulerPart(scheduler, TRAINING), state, "ckpt")
    assert position == ResumeState(step=7, consumed_samples=56, gamma=0.25, skipped_iters=1)
    assert (metadata.world_size, metadata.layout["pp"], metadata.optimizer_format,
            metadata.fingerprint, metadata.config) == (
        2, 2, "dp_reshardable", {"hidden": 64}, {"model": {"hidden_size": 64}})
    _, reference_optimizer = _scheduler(steps=7)  # the schedule stepped by hand
    assert scheduler.num_steps == 7
    assert optimizer.param_groups[0]["lr"] == reference_optimizer.param_groups[0]["lr"]


def test_older_checkpoints_without_later_keys_load_with_their_defaults():
    state = run_state_of(_parts())
    for key in ("gamma", "skipped_iters", "layout", "optimizer_format", "config"):
        del state[key]
    position, metadata = ResumeState(), RunMetadata()
    read_part(position, state, "ckpt")
    read_part(metadata, state, "ckpt")
    assert (position.gamma, position.skipped_iters) == (None, 0)
    assert (metadata.layout, metadata.optimizer_format) == (None, None)


@pytest.mark.parametrize("key,part,fix", [
    ("step", "position", "--finetune"),
    ("consumed_samples", "position", "--finetune"),
    ("scheduler", "scheduler", "--no-load-optim"),
    ("fingerprint", "run metadata", "--load"),
])
def test_a_missing_part_names_the_part_and_the_fix(key, part, fix):
    state = run_state_of(_parts())
    del state[key]
    target = {"position": ResumeState(), "run metadata": RunMetadata(),
              "scheduler": SchedulerPart(_scheduler()[0], TRAINING)}[part]
    with pytest.raises(CheckpointError) as err:
        read_part(target, state, "/ckpt/iter_0000007")
    message = str(err.value)
    assert f"has no {part} part (missing {key})" in message and fix in message
    assert message.startswith("/ckpt/iter_0000007: run_state.json")


def _draws():
    return (torch.rand(3).tolist(), [random.random() for _ in range(3)],
            np.random.rand(3).tolist())


def test_rng_part_round_trips_every_generator():
    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    saved = RngPart().state_dict()
    expected = _draws()  # the naive reference: what comes next after the save
    _draws()  # move every generator on
    RngPart().load_state_dict(torch.load(_saved_to_disk(saved), weights_only=True))
    assert _draws() == expected


def _saved_to_disk(state):
    """As checkpoint.py writes it (torch.save, read back with weights_only)."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer
