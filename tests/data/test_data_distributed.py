"""Dataset building on 2 gloo ranks: rank 0 builds the index caches, both ranks read
them, and each data-parallel rank gets its own slice of the same global order."""

import os

import torch

from megatron_mvmoe.data.loader import DataConfig, build_datasets, microbatches
from megatron_mvmoe.testing.spawn import run_distributed


def _config(data_dir, cache_dir):
    return DataConfig(data_dir=data_dir, seq_length=16, micro_batch_size=2,
                      global_batch_size=4, train_samples=40, cache_dir=cache_dir)


def _rank_batches(rank, world_size, data_dir, cache_dir):
    bundle = build_datasets(_config(data_dir, cache_dir))
    batches = microbatches(bundle.train, 2, dp_rank=rank, dp_size=world_size)
    return [next(batches)["tokens"] for _ in range(3)]


def test_two_ranks_share_caches_and_split_batches(data_dir, tmp_path):
    cache = str(tmp_path / "cache")
    per_rank = run_distributed(_rank_batches, 2, timeout_s=120, args=(data_dir, cache))
    cached = os.listdir(cache)
    assert any("BlendedDataset" in name for name in cached)
    assert any("GPTDataset" in name for name in cached)
    # The same order as one process reading the whole global batch.
    bundle = build_datasets(_config(data_dir, cache))
    whole = microbatches(bundle.train, 4)
    for step in range(3):
        expected = next(whole)["tokens"]
        assert torch.equal(torch.cat([per_rank[0][step], per_rank[1][step]]), expected)
