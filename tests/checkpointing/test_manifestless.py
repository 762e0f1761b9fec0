"""A checkpoint without its manifest.json (issue 25 finding 5): it loaded and trained after
a one-line warning even with 64 bytes flipped in a shard. Megatron's dist-checkpointing
0.19.2 (torch_dist) records each shard item's file, offset and length in `.metadata`, but no
checksum: the shard sizes are checked against it, and the load then needs the explicit
--ckpt-allow-unverified (the error names it)."""

from __future__ import annotations

import os
import shutil

import pytest

from harness import tiny_run, train

from megatron_mvmoe.testing.spawn import DistributedTestError  # noqa: E402

pytestmark = pytest.mark.timeout(600)
SAVED_AT = 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory, text_tokens):
    data = text_tokens
    root = str(tmp_path_factory.mktemp("ck"))
    train(tiny_run(data, preset="tiny_latent", train_iters=SAVED_AT, eval_iters=0,
                   save=root), 1)
    return data, root


def _without_manifest(root, tmp_path):
    copy = str(tmp_path / "ck")
    shutil.copytree(root, copy)
    os.remove(os.path.join(copy, f"iter_{SAVED_AT:07d}", "manifest.json"))
    return copy, os.path.join(copy, f"iter_{SAVED_AT:07d}", "__0_0.distcp")


def _resume(data, root, **training):
    return train(tiny_run(data, preset="tiny_latent", train_iters=SAVED_AT + 1, eval_iters=0,
                          load=root, **training), 1)


def test_flipped_bytes_without_manifest_are_refused_naming_the_flag(saved, tmp_path):
    data, root = saved
    copy, shard = _without_manifest(root, tmp_path)
    with open(shard, "r+b") as fh:  # the case: 64 bytes flipped in a shard
        fh.seek(os.path.getsize(shard) // 2)
        chunk = fh.read(64)
        fh.seek(-64, os.SEEK_CUR)
        fh.write(bytes(b ^ 0xFF for b in chunk))
    with pytest.raises(DistributedTestError, match="has no manifest.json, so its bytes "
                       "cannot be verified.*--ckpt-allow-unverified"):
        _resume(data, copy)


def test_allow_unverified_loads_an_intact_manifestless_checkpoint(saved, tmp_path):
    data, root = saved
    copy, _ = _without_manifest(root, tmp_path)
    out = _resume(data, copy, ckpt_allow_unverified=True)
    assert out["first_step"] == SAVED_AT + 1 and len(out["losses"]) == 1


def test_truncated_shard_is_refused_even_with_the_flag(saved, tmp_path):
    data, root = saved
    copy, shard = _without_manifest(root, tmp_path)
    with open(shard, "r+b") as fh:
        fh.truncate(os.path.getsize(shard) - 100)
    with pytest.raises(DistributedTestError, match="__0_0.distcp has .* bytes, .metadata "
                       "says"):
        _resume(data, copy, ckpt_allow_unverified=True)


def test_flag_reaches_the_run_config():
    from megatron_mvmoe.config.flags import config_from_args

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = os.path.join(repo, "examples", "tiny_cpu.yaml")
    run = config_from_args(["--config", config, "--ckpt-allow-unverified", "--finetune"])
    assert run.training.ckpt_allow_unverified and run.training.finetune


def _verify_both_ways(rank, world_size, directory):
    """verify_checkpoint's message without the flag, then whether it passes with it."""
    from megatron_mvmoe.checkpointing.directory import verify_checkpoint
    from megatron_mvmoe.checkpointing.errors import CheckpointError

    try:
        verify_checkpoint(directory)
        refused = None
    except CheckpointError as err:
        refused = str(err)
    verify_checkpoint(directory, allow_unverified=True)
    return refused


def test_an_edited_run_state_is_named_as_a_metadata_edit_not_corruption(saved, tmp_path, capfd):
    """Issue 35: hand-editing run_state.json (every tensor shard intact) was reported as a
    corrupt checkpoint whose fix is deleting it."""
    from megatron_mvmoe.testing.spawn import run_distributed

    _, root = saved
    copy = str(tmp_path / "ck")
    shutil.copytree(root, copy)
    directory = os.path.join(copy, f"iter_{SAVED_AT:07d}")
    with open(os.path.join(directory, "run_state.json"), "a") as fh:
        fh.write("\n")  # any edit: the manifest's size and checksum no longer match
    refused = run_distributed(_verify_both_ways, 1, args=(directory,))[0]
    assert refused == (f"{directory}/run_state.json differs from manifest.json while every "
                       "tensor file matches it (the run metadata was edited). Fix: restore the "
                       "original run_state.json, or pass --ckpt-allow-unverified to load it as "
                       "edited (the tensor files are still verified)")
    assert capfd.readouterr().out.count("loading it as edited (--ckpt-allow-unverified)") == 1
