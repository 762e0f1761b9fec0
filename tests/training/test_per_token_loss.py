"""--calculate-per-token-loss (training.calculate_per_token_loss) means what it means in
Megatron-LM: the loss and the gradients are those of the token mean over the whole global
batch, not the mean of the microbatch means. Checked at DP 2 (2 microbatches per rank) with
uneven loss masks against a naive reference: one forward of all 8 sequences, sum(loss x
mask) / sum(mask), backward."""

import copy

import pytest

from harness import tiny_run
from megatron_mvmoe.testing.spawn import run_distributed

SEQ = 32
KEPT = [32, 3, 17, 32, 9, 28, 1, 20]
"""Loss-mask length of each of the global batch's 8 sequences (uneven, so the token mean
and the mean of microbatch means differ)."""


def _global_batch():
    import torch

    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 512, (len(KEPT), SEQ + 1), generator=gen)
    mask = (torch.arange(SEQ)[None, :] < torch.tensor(KEPT)[:, None]).float()
    return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=mask,
                position_ids=torch.arange(SEQ).expand(len(KEPT), SEQ).clone())


def _rows(batch, rows):
    return {key: value[rows] for key, value in batch.items()}


def _grads(trainer):
    return {name: param.main_grad.detach().clone()
            for name, param in trainer.model[0].module.named_parameters()}


def _naive_reference(trainer, batch, rows_per_mean):
    """(loss, grads) of the mean over groups of `rows_per_mean` sequences of sum(loss x
    mask) / sum(mask), all 8 sequences in one forward (no DP reduce: every rank computes it
    alone). rows_per_mean 8: the token mean; 2: the mean of the microbatch means."""
    chunk = trainer.model[0]
    chunk.zero_grad_buffer()
    with chunk.no_sync():
        losses = chunk.module(batch["tokens"], batch["position_ids"], None,
                              labels=batch["labels"]).float() * batch["loss_mask"]
        groups = range(0, len(KEPT), rows_per_mean)
        loss = sum(losses[i:i + rows_per_mean].sum() / batch["loss_mask"][i:i + rows_per_mean]
                   .sum() for i in groups) / len(groups)
        loss.backward()
    return float(loss), _grads(trainer)


def _worst_rel_diff(grads, ref_grads):
    return max(float((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max()
                     .clamp(min=1e-12)) for n in grads)


def _per_token_step(rank, world, raw):
    import torch.distributed as dist

    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training import step
    from megatron_mvmoe.training.build import build_trainer

    run = config_from_dict(copy.deepcopy(raw))
    pgs = initialize_layout(run.parallel.layout(), timeout_s=60)
    trainer = build_trainer(run, pgs)
    batch = _global_batch()
    mine = [_rows(batch, slice(4 * pgs.dp.rank() + 2 * i, 4 * pgs.dp.rank() + 2 * i + 2))
            for i in range(2)]
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    losses = step._run_schedule(trainer, pgs, [iter(mine)], 2, forward_only=False)
    reported, grads = step._mean_loss(pgs, losses), _grads(trainer)
    ref_loss, ref_grads = _naive_reference(trainer, batch, rows_per_mean=len(KEPT))
    means_loss, means_grads = _naive_reference(trainer, batch, rows_per_mean=2)
    return {"reported": reported, "reference": ref_loss, "mean_of_means": means_loss,
            "worst_rel_grad_diff": _worst_rel_diff(grads, ref_grads),
            "mean_of_means_rel_grad_diff": _worst_rel_diff(means_grads, ref_grads),
            "world": dist.get_world_size()}


@pytest.mark.timeout(300)
def test_per_token_loss_is_the_global_batch_token_mean_at_dp2(text_tokens):
    raw = tiny_run(text_tokens, preset="tiny_dense", global_batch_size=8, micro_batch_size=2,
                   calculate_per_token_loss=True)
    assert raw["model"]["seq_length"] == SEQ
    raw["optimizer"]["use_distributed_optimizer"] = False  # main_grad: the whole gradient
    result = run_distributed(_per_token_step, 2, timeout_s=240, args=(raw,))[0]
    assert result["world"] == 2
    assert result["reported"] == pytest.approx(result["reference"], rel=1e-6), result
    assert result["worst_rel_grad_diff"] < 1e-5, result
    # the masks are uneven enough that the mean of microbatch means (the default) fails both
    assert abs(result["mean_of_means"] - result["reference"]) > 1e-4, result
    assert result["mean_of_means_rel_grad_diff"] > 1e-2, result


def test_the_flag_sets_the_field_and_megatrons_configs():
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.models.build import model_config

    run = config_from_args(["--model-preset", "tiny_dense", "--calculate-per-token-loss"])
    assert run.training.calculate_per_token_loss
    assert model_config(run).calculate_per_token_loss  # schedule, DDP and finalize read it
