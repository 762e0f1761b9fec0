"""Build a small Megatron-Core GPTModel from a decoder-block spec and run one training
step through Megatron's own forward-backward schedule (PP=1 or 1F1B with PP>1), DDP
wrapper and `finalize_model_grads`, for layout-parity tests.

Data parallel ranks each take their slice of one fixed global batch, so every layout sees
the same tokens; the returned loss is the global-batch mean on every rank. Context-parallel
ranks of one DP rank split its microbatches as the trainer does (training/step.py).
"""

from __future__ import annotations

from functools import partial
from typing import Dict, List

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_mvmoe.platform import seed_all
from megatron_mvmoe.testing.deterministic_init import deterministic_init, local_grads
from megatron_mvmoe.training.step import this_cp_rank_part, token_mean_loss


def build_gpt(config, block_spec, vocab_size: int, seq_len: int, pg_collection,
              seed: int = 0) -> DistributedDataParallel:
    """A GPTModel for this pipeline stage with deterministic weights, wrapped in DDP."""
    seed_all(seed)
    model = GPTModel(
        config=config, transformer_layer_spec=block_spec, vocab_size=vocab_size,
        max_sequence_length=seq_len,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute",
        pg_collection=pg_collection)
    deterministic_init(model, seed=seed)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                               overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                   pg_collection=pg_collection)


def global_batch(batch: int, seq_len: int, vocab_size: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq_len + 1),
                         generator=torch.Generator().manual_seed(seed))


def _microbatches(tokens_BS1: torch.Tensor, micro_batch: int) -> List[Dict[str, torch.Tensor]]:
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    local = tokens_BS1.chunk(dp_size, dim=0)[dp_rank]
    seq = local.shape[1] - 1
    batches = []
    for mb in local.split(micro_batch, dim=0):
        batches.append({
            "tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous(),
            "loss_mask": torch.ones(mb.shape[0], seq),
            "position_ids": torch.arange(seq).unsqueeze(0).expand(mb.shape[0], -1),
        })
    return batches


def _forward_step(cp_group, data_iterator, model):
    # The trainer's own CP split and CP loss reduction (training/step.py), so a CP layout
    # here is the one the trainer runs.
    batch = this_cp_rank_part(next(data_iterator), cp_group)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(token_mean_loss, cp_group, batch["loss_mask"])


def train_step_losses_and_grads(model: DistributedDataParallel, config, tokens_BS1: torch.Tensor,
                                micro_batch: int, pg_collection) -> Dict:
    """One forward+backward over the global batch; mean loss and this rank's grads."""
    model.zero_grad_buffer()
    batches = _microbatches(tokens_BS1, micro_batch)
    seq_len = tokens_BS1.shape[1] - 1
    config.finalize_model_grads_func = finalize_model_grads
    forward_backward = get_forward_backward_func()
    losses = forward_backward(
        forward_step_func=partial(_forward_step, pg_collection.cp), data_iterator=iter(batches), model=[model],
        num_microbatches=len(batches), seq_length=seq_len, micro_batch_size=micro_batch,
        forward_only=False)
    loss = _global_mean_loss(losses)
    return {"loss": loss, "grads": local_grads(model)}


def _global_mean_loss(losses: List[Dict]) -> float:
    """Mean loss over microbatches and data-parallel ranks, broadcast from the last stage."""
    value = torch.zeros(1)
    if parallel_state.is_pipeline_last_stage():
        value += torch.stack([d["lm loss"] for d in losses]).mean()
        dist.all_reduce(value, group=parallel_state.get_data_parallel_group())
        value /= parallel_state.get_data_parallel_world_size()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    last = parallel_state.get_pipeline_model_parallel_last_rank()
    dist.broadcast(value, src=last, group=pp_group)
    return float(value.item())


def assert_matches_reference(results: List[Dict], reference: Dict, loss_atol: float = 1e-5,
                             grad_atol: float = 1e-5) -> None:
    """Every rank's loss equals the single-rank reference, and the gradients rebuilt from
    all ranks' shards equal the reference's parameter by parameter."""
    from megatron_mvmoe.testing.deterministic_init import merge_rank_grads

    for r in results:
        assert abs(r["loss"] - reference["loss"]) < loss_atol, (r["loss"], reference["loss"])
    grads = merge_rank_grads([r["grads"] for r in results])
    ref_grads = merge_rank_grads([reference["grads"]])
    assert set(grads) == set(ref_grads), set(grads) ^ set(ref_grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=grad_atol, rtol=1e-4, msg=name)
