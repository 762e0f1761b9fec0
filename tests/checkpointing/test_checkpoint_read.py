"""Reading a checkpoint without a trainer (models.build.build_model +
checkpointing.weights.load_weights) against the naive reference: the trainer's own weights
in memory at the moment it saved.

One module-scoped run: the trainer trains a tiny Multi-View MoE 2 steps at EP = 2 on two
gloo ranks and saves; each test then reads that checkpoint in fresh processes (a fresh
process group): at the same layout every local tensor is bit-identical; the analysis route
(`checkpoint.open_model`, EP = 1 on one rank) gets the same dense weights; a corrupt or
mismatched checkpoint is one CheckpointError naming the problem and the fix.
"""

from __future__ import annotations

import copy
import glob
import os
import shutil
from typing import Dict

import pytest
import torch

from harness import tiny_run

from megatron_mvmoe.testing.spawn import run_distributed  # noqa: E402

pytestmark = pytest.mark.timeout(600)
WORLD = 2


def _tensors(chunks) -> Dict[str, torch.Tensor]:
    """Every tensor a chunk's state dict holds (parameters and buffers, expert bias too)."""
    return {f"{i}.{name}": value.detach().cpu().clone()
            for i, chunk in enumerate(chunks) for name, value in chunk.state_dict().items()
            if torch.is_tensor(value)}


def _train_and_save(rank, world_size, raw):
    """The reference: the trainer's weights in memory right after its final save."""
    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training.pretrain import pretrain

    run = config_from_dict(copy.deepcopy(raw))
    pgs = initialize_layout(run.parallel.layout(),
                            timeout_s=run.parallel.distributed_timeout_seconds)
    seen = {}
    pretrain(run, pgs, on_step=lambda step, trainer: seen.setdefault("trainer", trainer))
    return _tensors(seen["trainer"].unwrapped())


def _read(rank, world_size, raw, root):
    """build_model + load_weights at the training layout, no trainer anywhere."""
    from megatron_mvmoe.checkpointing.fingerprint import run_fingerprint
    from megatron_mvmoe.checkpointing.weights import load_weights
    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.models.build import build_model
    from megatron_mvmoe.parallel import initialize_layout

    run = config_from_dict(copy.deepcopy(raw))
    chunks = build_model(run, initialize_layout(run.parallel.layout()))
    meta = load_weights(chunks, root, run_fingerprint(run))
    return {"step": meta["step"], "tensors": _tensors(chunks)}


def _open_for_analysis(rank, world_size, root):
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.toolkit import checkpoint

    run = checkpoint.run_config(checkpoint=root)  # the stored config, at EP = 1
    opened = checkpoint.open_model(run, initialize_layout(run.parallel.layout()), root)
    return {"source": opened.source, "variant": opened.config.moe_variant,
            "tensors": _tensors([opened.model])}


def _load_error(rank, world_size, raw, root):
    """The CheckpointError's message (None when the load succeeds)."""
    from megatron_mvmoe.checkpointing.errors import CheckpointError
    from megatron_mvmoe.checkpointing.fingerprint import run_fingerprint
    from megatron_mvmoe.checkpointing.weights import load_weights
    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.models.build import build_model
    from megatron_mvmoe.parallel import initialize_layout

    run = config_from_dict(copy.deepcopy(raw))
    chunks = build_model(run, initialize_layout(run.parallel.layout()))
    try:
        load_weights(chunks, root, run_fingerprint(run))
    except CheckpointError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def saved(tmp_path_factory, text_tokens):
    data = text_tokens
    root = str(tmp_path_factory.mktemp("ck"))
    raw = tiny_run(data, parallel={"ep": WORLD}, train_iters=2, save=root)
    raw["optimizer"]["warmup_iters"] = 1  # must stay below the 2 decay steps
    reference = run_distributed(_train_and_save, WORLD, timeout_s=300, args=(raw,),
                                daemon=False)
    return {"raw": raw, "root": root, "reference": reference}


def test_load_weights_is_bit_identical_to_the_trainer(saved):
    read = run_distributed(_read, WORLD, timeout_s=300, args=(saved["raw"], saved["root"]))
    for rank, (got, want) in enumerate(zip(read, saved["reference"])):
        assert got["step"] == 2
        assert got["tensors"].keys() == want.keys(), rank
        differing = [k for k in want if not torch.equal(got["tensors"][k], want[k])]
        assert differing == [], f"rank {rank}: {differing[:5]}"


def test_open_model_reads_the_trained_weights_on_one_rank(saved):
    (opened,) = run_distributed(_open_for_analysis, 1, timeout_s=300, args=(saved["root"],))
    assert opened["source"] == f"checkpoint:{os.path.abspath(saved['root'])}"
    assert opened["variant"] == "multi_view"
    # EP = 2 -> 1 reshards the experts; every other tensor is the same on both ranks.
    want = saved["reference"][0]
    dense = [k for k in want if "experts" not in k]
    assert dense and all(torch.equal(opened["tensors"][k], want[k]) for k in dense)
    experts = [k for k in opened["tensors"] if "experts" in k]
    assert experts and sum(opened["tensors"][k].numel() for k in experts) == sum(
        ref[k].numel() for ref in saved["reference"] for k in ref if "experts" in k)


def test_another_model_is_refused_naming_the_fields(saved):
    raw = copy.deepcopy(saved["raw"])
    raw["model"]["preset"] = "tiny_latent"
    (message,) = run_distributed(_load_error, 1, timeout_s=300,
                                 args=(dict(raw, parallel={}), saved["root"]))
    assert message is not None and "incompatible model" in message
    assert "moe_variant: checkpoint 'multi_view' vs this run 'latent'" in message
    assert "Fix:" in message


def test_a_corrupt_checkpoint_is_refused_naming_the_file(saved, tmp_path):
    root = str(tmp_path / "ck")
    shutil.copytree(saved["root"], root)
    (shard,) = glob.glob(os.path.join(root, "iter_*", "*.distcp"))[:1]
    with open(shard, "r+b") as fh:  # same size, one byte altered
        first = fh.read(1)
        fh.seek(0)
        fh.write(bytes([first[0] ^ 0xFF]))
    (message,) = run_distributed(_load_error, 1, timeout_s=300,
                                 args=(dict(saved["raw"], parallel={}), root))
    assert message is not None and "corrupt checkpoint" in message
    assert os.path.basename(shard) in message and "SHA-256" in message
    assert "Fix:" in message
