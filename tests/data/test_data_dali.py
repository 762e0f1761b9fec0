"""The DALI backend yields exactly the torch backend's microbatches (CPU pipeline)."""

import pytest
import torch

from megatron_mvmoe.data.dali_loader import dali_microbatches
from megatron_mvmoe.data.loader import DataConfig, build_datasets, microbatches


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_dali_matches_torch_batches(data_dir, dp_rank):
    pytest.importorskip("nvidia.dali", reason="pip install nvidia-dali-cuda120 to test DALI")
    config = DataConfig(data_dir=data_dir, seq_length=16, micro_batch_size=2,
                        global_batch_size=4, train_samples=24)
    bundle = build_datasets(config)
    expected = list(microbatches(bundle.train, 2, dp_rank=dp_rank, dp_size=2))
    got = list(dali_microbatches(bundle.train, 2, dp_rank=dp_rank, dp_size=2))
    assert len(got) == len(expected) == len(bundle.train) // 4
    for a, b in zip(expected, got):
        assert set(a) == set(b)
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


def test_dali_missing_package_message(monkeypatch):
    import builtins

    from megatron_mvmoe.data import dali_loader

    real_import = builtins.__import__

    def no_dali(name, *args, **kwargs):
        if name.startswith("nvidia.dali"):
            raise ImportError("No module named 'nvidia.dali'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_dali)
    with pytest.raises(ImportError, match="pip install nvidia-dali-cuda120"):
        dali_loader._import_dali()
