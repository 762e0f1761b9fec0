"""Optional NVIDIA DALI backend: the same microbatches as `loader.microbatches`, fed
through a DALI pipeline.

Design choices:
- Samples still come from Megatron's GPTDataset/BlendedDataset (same order, same
  PretrainingSampler slices per data-parallel rank); DALI only moves them, via
  `fn.external_source` in batch mode, so the two backends give identical batches and
  DALI's prefetching overlaps sample assembly with the training step.
- CPU pipelines (`device_id=None`) by default, so the backend runs, and is tested, on
  machines without a GPU; pass a device id to get the batches on that GPU.
- DALI is optional and heavy (about 1 GB): it is imported only when this backend is
  asked for, with an ImportError naming the package when it is missing.
- DALI has no 0-d samples: scalar fields (the blend's `dataset_id`) travel as shape [1]
  and come back as [B], as torch's default collate gives them.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional

import numpy as np
import torch

from megatron_mvmoe.data.loader import PretrainingSampler

DALI_PACKAGE = "nvidia-dali-cuda120"


def _import_dali():
    try:
        from nvidia.dali import fn, pipeline_def
        from nvidia.dali.plugin.pytorch import DALIGenericIterator
    except ImportError as exc:
        raise ImportError(f"the DALI data backend needs NVIDIA DALI: pip install "
                          f"{DALI_PACKAGE} (CPU pipelines work without a GPU), or use "
                          "the torch backend (loader.microbatches)") from exc
    return fn, pipeline_def, DALIGenericIterator


class _BatchSource:
    """DALI batch-mode callback: microbatch k of this rank as one numpy list per key."""

    def __init__(self, dataset, sampler: PretrainingSampler, keys):
        self.dataset, self.sampler, self.keys = dataset, sampler, keys

    def __call__(self, batch_info):
        ids = self.sampler.batch_at(batch_info.iteration)
        if ids is None:
            raise StopIteration
        samples = [self.dataset[i] for i in ids]
        return tuple([_as_numpy(s[key]) for s in samples] for key in self.keys)


def _as_numpy(value) -> np.ndarray:
    array = value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    return array.reshape(1) if array.ndim == 0 else np.ascontiguousarray(array)


def dali_microbatches(dataset, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                      consumed_samples: int = 0, num_threads: int = 1,
                      device_id: Optional[int] = None,
                      prefetch_queue_depth: int = 2) -> Iterator[Dict[str, torch.Tensor]]:
    """Microbatches of `dataset` for one DP rank through a DALI pipeline."""
    fn, pipeline_def, DALIGenericIterator = _import_dali()
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 dp_rank, dp_size)
    keys = list(dataset[0].keys())
    scalar_keys = {k for k in keys if _as_numpy(dataset[0][k]).shape == (1,)
                   and np.ndim(dataset[0][k]) == 0}
    source = _BatchSource(dataset, sampler, keys)

    @pipeline_def(batch_size=micro_batch_size, num_threads=num_threads, device_id=device_id,
                  prefetch_queue_depth=prefetch_queue_depth)
    def pipeline():
        return tuple(fn.external_source(source=source, num_outputs=len(keys), batch=True,
                                        batch_info=True))

    pipe = pipeline()
    pipe.build()
    for outputs in DALIGenericIterator(pipe, keys, auto_reset=False):
        batch = outputs[0]  # one pipeline
        yield {k: (v.squeeze(-1) if k in scalar_keys else v) for k, v in batch.items()}
