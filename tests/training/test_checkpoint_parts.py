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
from megatron_mvmoe.training import checkpoint_parts
from megatron_mvmoe.training.checkpoint_parts import (TRACKER_KEY, ResumeState, RngPart,
                                                      RunMetadata, SchedulerPart, read_part,
                                                      run_state_of)

pytestmark = pytest.mark.timeout(60)

# The run_state.json keys every checkpoint since the format was fixed has carried, written
# out by hand: the parts must produce exactly these (no more, no fewer).
HISTORICAL_KEYS = {"format", "step", "consumed_samples", "gamma", "skipped_iters",
                   "world_size", "layout", "optimizer_format", "scheduler", "fingerprint",
                   "config"}
LATER_KEYS = {"ckpt_format"}
"""Added since: optional, absent in older checkpoints (their value implied)."""


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
    assert set(state) == HISTORICAL_KEYS | LATER_KEYS
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
    for key in ("gamma", "skipped_iters", "layout", "optimizer_format", "config",
                "ckpt_format"):
        del state[key]
    position, metadata = ResumeState(), RunMetadata()
    read_part(position, state, "ckpt")
    read_part(metadata, state, "ckpt")
    assert (position.gamma, position.skipped_iters) == (None, 0)
    assert (metadata.layout, metadata.optimizer_format) == (None, None)
    assert metadata.ckpt_format == "torch_dist"  # every checkpoint before the field


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


PART_CLASSES = ("ResumeState", "SchedulerPart", "RunMetadata", "RngPart", "ModelPart",
                "OptimizerPart")


@pytest.mark.parametrize("part", PART_CLASSES)
def test_every_part_implements_its_protocol(part):
    """Each part has a name, a store and both Stateful methods (OptimizerPart had no
    state_dict before the parts were iterated)."""
    cls = getattr(checkpoint_parts, part)
    assert callable(getattr(cls, "state_dict", None)), part
    assert callable(getattr(cls, "load_state_dict", None)), part
    assert isinstance(getattr(cls, "name", None), str) and isinstance(
        getattr(cls, "store", None), str), part


def test_loading_ways_exclude_the_declared_parts():
    """Megatron-LM's flags, written out: --no-load-optim keeps step and data position and
    loads no optimizer, scheduler or rng; --finetune loads the weights only; the model
    and the run metadata always load."""
    from megatron_mvmoe.training.checkpoint_parts import EXCLUDE_FROM_LOADING, loading_way

    assert loading_way(load_optimizer=True, finetune=False) == "resume"
    assert loading_way(load_optimizer=False, finetune=False) == "--no-load-optim"
    assert loading_way(load_optimizer=True, finetune=True) == "--finetune"
    assert loading_way(load_optimizer=False, finetune=True) == "--finetune"
    assert EXCLUDE_FROM_LOADING == {
        "resume": set(), "--no-load-optim": {"optimizer", "scheduler", "rng"},
        "--finetune": {"optimizer", "scheduler", "rng", "position"}}


def _draws():
    return (torch.rand(3).tolist(), [random.random() for _ in range(3)],
            np.random.rand(3).tolist())


@pytest.fixture
def tracker():
    """Megatron's RNG tracker holding two named CPU generator states (as the CPU patches
    make it hold them); emptied again afterwards."""
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.reset()
    tracker.set_states({name: torch.Generator().manual_seed(seed).get_state()
                        for name, seed in (("model-parallel-rng", 6), ("expert-parallel-rng", 7))})
    yield tracker
    tracker.reset()


def _tracker_draws(tracker):
    """The next draws of each named state, through a generator of its own (the naive
    reference: what a fork of that state would draw)."""
    draws = {}
    for name, state in tracker.get_states().items():
        generator = torch.Generator()
        generator.set_state(state)
        draws[name] = torch.rand(3, generator=generator).tolist()
    return draws


def _advance(tracker):
    tracker.set_states({name: torch.Generator().manual_seed(99 + i).get_state()
                        for i, name in enumerate(tracker.get_states())})


def test_rng_part_round_trips_every_generator(tracker):
    torch.manual_seed(3)
    random.seed(4)
    np.random.seed(5)
    saved = RngPart().state_dict()
    expected = _draws(), _tracker_draws(tracker)  # what comes next after the save
    _draws()  # move every generator on
    _advance(tracker)
    part = RngPart()
    part.load_state_dict(torch.load(_saved_to_disk(saved), weights_only=True))
    assert (_draws(), _tracker_draws(tracker)) == expected and part.tracker_restored


def test_rng_part_without_tracker_states_loads_the_rest(tracker):
    """A file written before the tracker states were kept (or with a GPU's 16-byte states
    on the CPU): the other generators are restored, the tracker is left as it is."""
    torch.manual_seed(3)
    saved, expected = RngPart().state_dict(), _draws()
    gpu_states = {name: torch.zeros(16, dtype=torch.uint8) for name in tracker.get_states()}
    for tracker_states in (None, gpu_states):
        old = {k: v for k, v in saved.items() if k != TRACKER_KEY}
        if tracker_states is not None:
            old[TRACKER_KEY] = tracker_states
        _draws()
        before = _tracker_draws(tracker)
        part = RngPart()
        part.load_state_dict(torch.load(_saved_to_disk(old), weights_only=True))
        assert _draws() == expected and not part.tracker_restored
        assert _tracker_draws(tracker) == before


def _saved_to_disk(state):
    """As checkpoint.py writes it (torch.save, read back with weights_only)."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def _load_rng_at_another_layout(rank, world_size, directory):
    """One gloo rank (tp = pp = ep = 1) loads the rng part of a checkpoint saved at world
    size 2, then at world size 1 but EP = 2: both must reseed; returns what each left."""
    from megatron.core import tensor_parallel

    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
    from megatron_mvmoe.platform import apply_cpu_patches
    from megatron_mvmoe.training.checkpoint import _load_rng

    apply_cpu_patches()
    initialize_layout(ParallelLayout())
    parallel = SimpleNamespace(tp=1, pp=1, ep=1, etp=1, vpp=None)
    trainer = SimpleNamespace(run=SimpleNamespace(training=SimpleNamespace(seed=1234),
                                                  parallel=parallel))
    left = []
    for saved in (RunMetadata(world_size=2, layout=dict(vars(parallel), ep=2)),
                  RunMetadata(world_size=1, layout=dict(vars(parallel), ep=2))):
        torch.rand(7)  # wherever the run's generators were
        _load_rng(trainer, directory, saved, step=7)
        left.append((torch.get_rng_state(), tensor_parallel.get_cuda_rng_tracker().get_states()))
    return left


def test_rng_part_of_another_layout_reseeds_from_seed_and_step(tmp_path, capfd):
    """Megatron's seeding rule, written out: the default generator gets seed, the tracker's
    model-parallel state seed + 2718 + tp_rank, its expert-parallel state seed + 1024 +
    100 ep_rank + etp_rank; here seed = 1234 + step 7."""
    from megatron_mvmoe.testing.spawn import run_distributed

    left = run_distributed(_load_rng_at_another_layout, 1, timeout_s=120,
                           args=(str(tmp_path),))[0]
    state = lambda seed: torch.Generator().manual_seed(seed).get_state()  # noqa: E731
    for torch_state, tracker_states in left:
        assert torch.equal(torch_state, state(1241))
        assert torch.equal(tracker_states["model-parallel-rng"], state(1241 + 2718))
        assert torch.equal(tracker_states["expert-parallel-rng"], state(1241 + 1024))
    out = capfd.readouterr().out
    assert out.count("rng: the checkpoint's generator states do not apply (saved at world "
                     "size") == 2 and "reseeded from (seed, step 7)" in out
