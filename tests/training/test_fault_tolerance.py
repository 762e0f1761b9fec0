"""Long-run safety on gloo ranks: NaN/inf steps are never applied (skipped and counted, or a
clear stop) and never saved; retention keeps the good checkpoint; a named step loads;
SIGUSR1/SIGTERM/SIGINT and the exit budgets save and stop, and the resumed run is bit-identical
to an uninterrupted one; damaged or unwritable checkpoints give one-line errors naming the file."""

import math
import re
import os
import shutil
import signal
import subprocess

import pytest
import torch

from harness import tiny_run, train, with_dropout
from megatron_mvmoe.testing.spawn import DistributedTestError
from megatron_mvmoe.checkpointing.integrity import prune

pytestmark = pytest.mark.timeout(600)


def _run(text_tokens, **training):
    return tiny_run(text_tokens, eval_iters=0, **training)


def _tensors_finite(checkpoint: str, tmp_path) -> bool:
    """Independent reader: torch's DCP -> torch.save converter, then every tensor."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = str(tmp_path / (os.path.basename(checkpoint) + ".pt"))
    dcp_to_torch_save(checkpoint, out)
    flat = []

    def walk(obj):
        if torch.is_tensor(obj):
            flat.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
    walk(torch.load(out, weights_only=False))
    assert flat, checkpoint
    return all(torch.isfinite(t.float()).all() for t in flat if t.is_floating_point())


def _iters(root):
    return sorted(d for d in os.listdir(root) if d.startswith("iter_"))


def _latest(root):
    with open(os.path.join(root, "latest")) as fh:
        return fh.read().strip()


def test_nan_step_is_skipped_counted_and_never_saved(text_tokens, tmp_path, capfd):
    root = tmp_path / "ck"
    (root / ".tmp_iter_0000099").mkdir(parents=True)  # an interrupted save of an old run
    out = train(_run(text_tokens, train_iters=6, save=str(root), save_interval=2,
                     skip_nonfinite=True), 1, hook=("nan", 3))
    losses = out["losses"]
    assert out["skipped_iters"] == 1 and math.isnan(losses[2])
    assert all(math.isfinite(x) for i, x in enumerate(losses) if i != 2), losses
    assert losses[-1] < losses[0]
    log = capfd.readouterr().out
    assert "step 3: loss nan" in log and "number of skipped iterations: 1" in log, log[-2000:]
    assert "removed 1 unfinished save(s)" in log and not (root / ".tmp_iter_0000099").exists()
    assert _iters(root) == ["iter_0000002", "iter_0000004", "iter_0000006"]
    assert all(_tensors_finite(str(root / d), tmp_path) for d in _iters(root))


def test_nan_step_stops_before_the_update_naming_the_good_checkpoint(text_tokens, tmp_path):
    root = tmp_path / "ck"
    with pytest.raises(DistributedTestError, match=r"training loss is nan, grad norm nan at "
                       r"step 3; .*the weights were not updated and \S+iter_0000002 holds "
                       r"finite weights\. Fix: .*--skip-nonfinite"):
        train(_run(text_tokens, train_iters=6, save=str(root), save_interval=2), 1,
              hook=("nan", 3))
    assert _iters(root) == ["iter_0000002"] and _latest(root) == "iter_0000002"


def test_nonfinite_weights_are_never_saved(text_tokens, tmp_path):
    root = tmp_path / "ck"
    with pytest.raises(DistributedTestError, match=r"refusing to save step 4: parameter "
                       r"\S*layers\.1\.self_attention\.linear_proj\S* on rank 0 is NaN/inf; "
                       r"the previous checkpoint \S+iter_0000002 is kept"):
        train(_run(text_tokens, train_iters=4, save=str(root), save_interval=2,
                   skip_nonfinite=True), 1, corrupt_at_step=3)
    assert _iters(root) == ["iter_0000002"] and _latest(root) == "iter_0000002"


def test_keep_last_and_load_a_named_step(text_tokens, tmp_path):
    root = str(tmp_path / "ck")
    full = train(_run(text_tokens, train_iters=6, save=root, save_interval=1, keep_last=2), 1)
    assert _iters(root) == ["iter_0000005", "iter_0000006"]
    again = train(_run(text_tokens, train_iters=6, load=root, ckpt_step=5), 1)
    assert again["first_step"] == 6 and again["losses"] == full["losses"][5:]
    with pytest.raises(DistributedTestError, match=r"--ckpt-step 2: \S+iter_0000002 is missing "
                       r"or incomplete\. Fix: use one of \['iter_0000005', 'iter_0000006'\]"):
        train(_run(text_tokens, train_iters=6, load=root, ckpt_step=2), 1)


def test_prune_never_deletes_what_latest_names(tmp_path):
    for step in (2, 4, 6):
        (tmp_path / f"iter_{step:07d}").mkdir()
    assert prune(str(tmp_path), 1, "iter_0000002") == ["iter_0000004"]
    assert _iters(tmp_path) == ["iter_0000002", "iter_0000006"]
    assert prune(str(tmp_path), 0, "iter_0000006") == []


def test_usr1_on_one_rank_saves_stops_and_resumes_bit_identically(text_tokens, tmp_path):
    """The requeue pattern: the same --save X --load X for the first launch (X empty) and
    the restart; rank 1 alone gets SIGUSR1 in step 3, both ranks stop after step 3. With
    dropout 0.1."""
    full = train(with_dropout(_run(text_tokens, parallel={"ep": 2}, train_iters=6)), 2)
    root = str(tmp_path / "ck")
    first = train(with_dropout(_run(text_tokens, parallel={"ep": 2}, train_iters=6, save=root,
                                     load=root)), 2, hook=("signal", 3, signal.SIGUSR1, 1))
    assert first["stopped"].startswith("SIGUSR1") and len(first["losses"]) == 3
    assert _iters(root) == ["iter_0000003"]
    second = train(with_dropout(_run(text_tokens, parallel={"ep": 2}, train_iters=6, save=root,
                                      load=root)), 2)
    assert second["stopped"] is None and second["first_step"] == 4
    assert first["losses"] + second["losses"] == full["losses"]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_save_the_step_in_progress(text_tokens, tmp_path, signum):
    root = str(tmp_path / "ck")
    out = train(_run(text_tokens, train_iters=4, save=root), 1, hook=("signal", 2, signum, 0))
    assert out["stopped"].startswith(signal.Signals(signum).name)
    assert len(out["losses"]) == 2 and _iters(root) == ["iter_0000002"]


@pytest.mark.parametrize("budget,stop_step", [({"exit_interval": 2}, 2),
                                              ({"exit_duration_in_mins": 1e-6}, 1)],
                         ids=["exit-interval", "exit-duration"])
def test_exit_budgets_save_and_stop(text_tokens, tmp_path, budget, stop_step):
    root = str(tmp_path / "ck")
    out = train(_run(text_tokens, train_iters=4, save=root, **budget), 1)
    assert out["stopped"] and len(out["losses"]) == stop_step
    assert _iters(root) == [f"iter_{stop_step:07d}"]


# ------------------------------------------------------------------------- integrity
@pytest.fixture(scope="module")
def saved(text_tokens, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("saved") / "ck")
    train(_run(text_tokens, train_iters=3, save=root, save_interval=1), 1)
    return root


def _damage(directory, how):
    shard = sorted(f for f in os.listdir(directory) if f.endswith(".distcp"))[0]
    path = os.path.join(directory, shard)
    if how == "bytes":
        with open(path, "r+b") as fh:
            fh.seek(os.path.getsize(path) // 2)
            fh.write(os.urandom(64))
        return shard
    if how == "truncate":
        os.truncate(path, os.path.getsize(path) // 3)
        return shard
    os.remove(os.path.join(directory, ".metadata"))
    return ".metadata"


@pytest.mark.parametrize("how,problem", [
    ("bytes", "does not match its SHA-256"), ("truncate", "has [0-9]+ bytes, the manifest says [0-9]+"),
    ("metadata", "is missing")], ids=["random-bytes", "truncated", "no-metadata"])
def test_damaged_checkpoint_is_one_line_naming_file_and_fix(text_tokens, saved, tmp_path, how,
                                                            problem):
    root = str(tmp_path / "ck")
    shutil.copytree(saved, root)
    name = _damage(os.path.join(root, "iter_0000003"), how)
    with pytest.raises(DistributedTestError) as info:
        train(_run(text_tokens, train_iters=4, load=root), 1)
    line = next(l for l in str(info.value).splitlines() if "CheckpointError:" in l)
    assert re.search(f"iter_0000003/{re.escape(name)} {problem}", line), line
    assert line.endswith(f"Fix: load an earlier checkpoint with --load {root} --ckpt-step 2 "
                         f"(or delete {root}/iter_0000003)"), line
    assert _tensors_finite(os.path.join(root, "iter_0000002"), tmp_path)  # nothing lost


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_full_disk_names_path_and_keeps_the_previous_checkpoint(text_tokens, saved, tmp_path,
                                                                background):
    size = sum(os.path.getsize(os.path.join(b, f)) for b, _, fs in
               os.walk(os.path.join(saved, "iter_0000002")) for f in fs)
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.5) // 4096 * 4096 + 4096}",
                    "tmpfs", str(mount)], check=True)
    try:
        root = str(mount / "ck")
        with pytest.raises(DistributedTestError) as info:
            train(_run(text_tokens, train_iters=4, save=root, save_interval=2,
                       async_save=background), 1)
        line = next((l for l in str(info.value).splitlines() if "CheckpointError:" in l),
                    str(info.value))
        assert f"no space left on device writing {root}/.tmp_iter_0000004; the previous " \
               f"checkpoint {root}/iter_0000002 is kept" in line, line
        assert _iters(root) == ["iter_0000002"]
        assert _latest(root) == "iter_0000002"
        assert not [d for d in os.listdir(root) if d.startswith(".tmp")]
        print(line)
        assert _tensors_finite(os.path.join(root, "iter_0000002"), tmp_path)
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_async_save_publishes_the_same_checkpoints_and_resumes_bit_identically(text_tokens,
                                                                               tmp_path):
    sync_root, async_root = str(tmp_path / "sync"), str(tmp_path / "async")
    sync = train(_run(text_tokens, parallel={"ep": 2}, train_iters=6, save=sync_root,
                      save_interval=2), 2)
    background = train(_run(text_tokens, parallel={"ep": 2}, train_iters=6, save=async_root,
                            save_interval=2, async_save=True), 2)
    assert background["losses"] == sync["losses"]
    assert _iters(async_root) == _iters(sync_root) == ["iter_0000002", "iter_0000004",
                                                       "iter_0000006"]
    assert background["last_checkpoint"].endswith("iter_0000006")
    with open(os.path.join(async_root, "latest"), "w") as fh:
        fh.write("iter_0000002\n")
    resumed = train(_run(text_tokens, parallel={"ep": 2}, train_iters=6, load=async_root), 2)
    assert resumed["losses"] == sync["losses"][2:]
