"""platform/cpu_uneven_gather.py: Megatron's gather of unequal token counts across a group
(the alltoall dispatcher at ETP > 1 with EP, Megatron-LM's default ETP = TP) runs on gloo and
gives, forward and backward, exactly the concatenation of every rank's rows; gloo itself
still refuses the unequal list (else the patch is stale)."""

import pytest
import torch

from megatron_mvmoe.testing.spawn import run_distributed

SPLITS = [3, 5]


def _gather_forward_backward(rank, world_size):
    import torch.distributed as dist
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    group = dist.new_group([0, 1])
    rows = torch.arange(SPLITS[rank] * 4, dtype=torch.float32).reshape(-1, 4) + 100 * rank
    rows.requires_grad_(True)
    gathered = gather_from_sequence_parallel_region(rows, group=group,
                                                    output_split_sizes=SPLITS)
    weight = torch.arange(gathered.numel(), dtype=torch.float32).reshape(gathered.shape)
    (gathered * weight * (rank + 1)).sum().backward()
    refused = None
    try:  # what Megatron's unpatched branch does
        dist.all_gather(list(torch.empty(sum(SPLITS), 4).split(SPLITS)), rows.detach(),
                        group=group)
    except RuntimeError as err:
        refused = str(err)
    return {"gathered": gathered.detach(), "grad": rows.grad, "refused": refused}


def test_uneven_gather_is_the_concatenation_forward_and_backward():
    out = run_distributed(_gather_forward_backward, 2, timeout_s=120)
    every_row = torch.cat([torch.arange(n * 4, dtype=torch.float32).reshape(-1, 4) + 100 * r
                           for r, n in enumerate(SPLITS)])
    weight = torch.arange(every_row.numel(), dtype=torch.float32).reshape(every_row.shape)
    summed = weight * (1 + 2)  # the backward reduce-scatters both ranks' gradients
    for rank, result in enumerate(out):
        assert torch.equal(result["gathered"], every_row)
        start = sum(SPLITS[:rank])
        assert torch.equal(result["grad"], summed[start:start + SPLITS[rank]])


def test_gloo_still_refuses_an_uneven_all_gather():
    if torch.cuda.is_available():
        pytest.skip("a GPU run uses NCCL")
    out = run_distributed(_gather_forward_backward, 2, timeout_s=120)
    assert all("invalid tensor size" in (r["refused"] or "") for r in out), out
