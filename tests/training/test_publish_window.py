"""No checkpoint is lost when a publish is killed (issue 35 item 1): running a finished
run's command again re-saved its last step by deleting the iter_N that `latest` named
before renaming the new copy into place; a kill -9 in between left `latest` naming a
half-deleted directory, and the next start-up deleted the complete new copy.

The kill is injected before each file operation of the publish in turn (kill_points.py),
not by timing: once through the real trainer in the window that lost the step, then at
every operation of the publish sequence (checkpointing/publish.py), re-saving a step and
saving a new one, each followed by the start-up recovery."""

import os
import shutil
from typing import Optional

import pytest

from harness import tiny_run, train
from kill_points import dying_at
from megatron_mvmoe.checkpointing.directory import resolve_checkpoint
from megatron_mvmoe.checkpointing.errors import CheckpointError
from megatron_mvmoe.testing.spawn import DistributedTestError, run_distributed

pytestmark = pytest.mark.timeout(600)
STEPS = 5  # saves at 2, 4 and 5


def _run(text_tokens, **training):
    return tiny_run(text_tokens, eval_iters=0, save_interval=2, **training)


@pytest.fixture(scope="module")
def finished(text_tokens, tmp_path_factory):
    """A finished run (the uninterrupted reference): its --save root and its losses."""
    root = str(tmp_path_factory.mktemp("finished") / "ck")
    out = train(_run(text_tokens, train_iters=STEPS, save=root, load=root), 1)
    return root, out["losses"]


def _stage(reference: str, root: str, new: Optional[str] = None) -> None:
    """root: iter_2 and iter_4 of the reference, `latest` -> iter_4, and (given `new`) a
    finished save of `new`, the reference's copy, in .tmp_<new>, ready to publish."""
    for name in ("iter_0000002", "iter_0000004"):
        shutil.copytree(os.path.join(reference, name), os.path.join(root, name))
    with open(os.path.join(root, "latest"), "w") as fh:
        fh.write("iter_0000004\n")
    if new is not None:
        shutil.copytree(os.path.join(reference, new), os.path.join(root, f".tmp_{new}"))


def _read(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read()


class Killed(BaseException):
    """Raised where the injected kill happens; nothing after it in the publish runs."""


def _die():
    raise Killed


def _kill_everywhere_then_recover(rank, world_size, reference, scratch, new, keep_last):
    """For k = 1, 2, ...: stage, publish `new` killed before operation k, run the start-up
    recovery; returns, per k, what `latest` names, whether its manifest is the reference's,
    what is left in the root and which iter_* dirs in it verify against their manifest."""
    from megatron_mvmoe.checkpointing.integrity import IntegrityError, verify_manifest
    from megatron_mvmoe.checkpointing.publish import TRACKER, publish, recover

    def complete(directory):
        try:
            return verify_manifest(directory, fix="-")
        except IntegrityError:
            return False

    seen = []
    for kill_at in range(1, 100):
        root = os.path.join(scratch, f"{new}_kill_{kill_at}")
        _stage(reference, root, new)
        with dying_at(kill_at, _die) as done:
            try:
                publish(root, new, keep_last)
            except Killed:
                pass
        recover(root)
        latest = _read(os.path.join(root, "latest")).decode().strip()
        left = sorted(d for d in os.listdir(root) if not d.endswith(".tmp"))
        tracker = os.path.join(root, TRACKER)
        manifest = os.path.join(root, latest, "manifest.json")
        seen.append(dict(kill_at=kill_at, latest=latest, left=left,
                         tracker=_read(tracker).decode() if os.path.isfile(tracker) else None,
                         reference=os.path.isfile(manifest) and _read(manifest) == _read(
                             os.path.join(reference, latest, "manifest.json")),
                         complete=[d for d in left if d.startswith("iter_") and
                                   complete(os.path.join(root, d))]))
        if done[0] < kill_at:  # this publish ran to the end: every operation was covered
            return seen
    raise AssertionError("the publish never ran to the end")


@pytest.mark.parametrize("new,keep_last,operations", [
    ("iter_0000004", 1, 9),   # the re-save `latest` names, pruning iter_2
    ("iter_0000005", 2, 6)],  # a new step, pruning iter_2
    ids=["re-save", "new-step"])
def test_kill_before_every_publish_operation_leaves_latest_complete(finished, tmp_path, new,
                                                                   keep_last, operations):
    """After a kill at any point and the start-up recovery, `latest` names a checkpoint
    whose manifest verifies and is byte for byte one the uninterrupted run saved (so its
    resume is that run's: the next test resumes one), every iter_* left is complete, and
    nothing half-done is left. Megatron-LM's tracker names `latest`'s step after every
    recovery, as Megatron-LM writes it (the bare number)."""
    reference, _ = finished
    seen = run_distributed(_kill_everywhere_then_recover, 1, timeout_s=120,
                           args=(reference, str(tmp_path), new, keep_last))[0]
    for case in seen:
        assert case["latest"] in ("iter_0000004", new) and case["reference"], case
        assert case["complete"] == [d for d in case["left"] if d.startswith("iter_")], case
        assert new in case["complete"] and "iter_0000004" in case["complete"], case
        assert [d for d in case["left"] if d.startswith(".")] == [], case
        assert case["tracker"] == str(int(case["latest"][len("iter_"):])), case
    assert len(seen) == operations + 1, seen  # each kill point, then an uninterrupted run
    assert seen[-1]["latest"] == new and "iter_0000002" not in seen[-1]["left"]


def test_kill_in_the_resave_window_then_resume_is_bit_identical(finished, text_tokens,
                                                                tmp_path, capfd):
    """The issue's window, through the trainer: re-saving iter_4 (which `latest` names),
    the process dies at the publish's second file operation (main: iter_4 half deleted, the
    new copy still in .tmp_iter_4); the next launch recovers and resumes exactly."""
    reference, losses = finished
    root = str(tmp_path / "ck")
    _stage(reference, root)
    with pytest.raises(DistributedTestError, match="rank 0 died with exit code 9"):
        train(_run(text_tokens, train_iters=4, save=root, load=root, ckpt_step=2), 1,
              hook=("kill_publish", 2))
    resumed = train(_run(text_tokens, train_iters=STEPS, save=root, load=root), 1)
    log = capfd.readouterr().out
    assert "recovered an interrupted save in" in log, log[-3000:]
    assert resumed["first_step"] == 5 and resumed["losses"] == losses[4:]


def test_launching_a_finished_run_again_does_not_rewrite_its_checkpoint(finished,
                                                                       text_tokens, tmp_path,
                                                                       capfd):
    reference, _ = finished
    root = str(tmp_path / "ck")
    shutil.copytree(reference, root)
    manifest = os.path.join(root, "iter_0000005", "manifest.json")
    before = os.stat(manifest).st_ino
    out = train(_run(text_tokens, train_iters=STEPS, save=root, load=root), 1)
    assert out["losses"] == [] and out["last_checkpoint"] == os.path.join(root, "iter_0000005")
    assert os.stat(manifest).st_ino == before
    assert "step 5 is already saved in" in capfd.readouterr().out


def test_a_reader_of_an_interrupted_publish_is_told_how_to_recover_it(tmp_path):
    """Tools do not recover a --save root (they only read it): the error names the
    interrupted publish and the launch that recovers it."""
    (tmp_path / ".old_iter_0000004").mkdir()
    (tmp_path / "latest").write_text("iter_0000004\n")
    with pytest.raises(CheckpointError, match=r"'latest' points at 'iter_0000004', which is "
                       r"missing .*Fix: saving iter_0000004 was interrupted while it was put "
                       rf"in place; a training launch with --save {tmp_path} recovers it"):
        resolve_checkpoint(str(tmp_path))
