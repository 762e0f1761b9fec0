"""Megatron-LM's Muon lines (--optimizer muon, --muon-*) train through Megatron-Core's own
get_megatron_optimizer (emerging-optimizers' Muon on 2-D weights, Adam on the rest), issue 36."""

from types import SimpleNamespace

import pytest
import torch

MUON_LINE = ["--model-preset", "tiny_smoe", "--optimizer", "muon", "--muon-momentum", "0.9",
             "--muon-extra-scale-factor", "0.2", "--muon-scale-mode", "spectral"]


def test_muon_flags_reach_megatron_core_optimizer_config_as_in_megatron_lm():
    """Megatron-LM passes --optimizer and every --muon-* flag to OptimizerConfig by name."""
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.training.build import optimizer_config

    run = config_from_args(MUON_LINE + ["--use-distributed-optimizer", "false"])
    got = optimizer_config(run, SimpleNamespace(bf16=False, fp16=False,
                                                params_dtype=torch.float32))
    assert (got.optimizer, got.muon_momentum, got.muon_extra_scale_factor,
            got.muon_scale_mode) == ("muon", 0.9, 0.2, "spectral")


@pytest.mark.parametrize("line, layout", [
    (MUON_LINE + ["--use-distributed-optimizer"], True),
    (MUON_LINE + ["--use-distributed-optimizer", "--no-use-layer-wise-param-layout"], False),
    (["--model-preset", "tiny_smoe", "--optimizer", "dist_muon"], True)])
def test_muon_with_a_distributed_optimizer_is_megatron_cores_layer_wise_optimizer(line, layout):
    """As Megatron-LM's arguments.py: Muon + --use-distributed-optimizer (or dist_muon) is
    OptimizerConfig.use_layer_wise_distributed_optimizer, not the ZeRO-1 optimizer; DDP
    shards only with the layer-wise parameter layout."""
    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.training.build import ddp_config, optimizer_config

    run = config_from_args(line + ["--bf16"])
    run.validate()
    got = optimizer_config(run, SimpleNamespace(bf16=True, fp16=False,
                                                params_dtype=torch.float32))
    assert (got.optimizer, got.use_layer_wise_distributed_optimizer,
            got.use_distributed_optimizer) == ("muon", True, False)
    assert ddp_config(run).use_distributed_optimizer is layout


def test_a_muon_run_trains_with_muon_and_resumes_exactly(tmp_path, text_tokens):
    """Muon's momentum buffers are in the checkpoint: a resume from step 2 repeats steps 3-4
    bit for bit; and the run is not Adam's (its losses differ from step 2 on)."""
    from harness import tiny_run, train

    raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=4, save_interval=2,
                   save=str(tmp_path / "ck"))
    raw["optimizer"].update(use_distributed_optimizer=False)
    adam = train(raw, 1)["losses"]
    raw["optimizer"].update(optimizer="muon", muon_extra_scale_factor=0.2)
    raw["training"].update(save=str(tmp_path / "muon"))
    full = train(raw, 1)["losses"]
    assert full[0] == adam[0] and full[1:] != adam[1:]
    raw["training"].update(load=str(tmp_path / "muon"), ckpt_step=2, save=str(tmp_path / "ck2"))
    assert train(raw, 1)["losses"] == full[2:]


QUINTIC = [(4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
           (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)]
"""emerging-optimizers' "quintic" Newton-Schulz coefficients, one set per step (5 steps)."""


def _naive_muon_update(grad, extra_scale):
    """Muon's first update of a 2-D weight written out: momentum (1 - m) * grad (a positive
    factor, which the normalisation removes), Newton-Schulz orthogonalisation of the
    Frobenius-normalised matrix (bf16 I/O under Megatron's default 'medium' fp32 matmul
    precision), times the spectral scale sqrt(max(out, in)) and the extra scale factor."""
    x = grad.float()
    transpose = x.shape[0] > x.shape[1]
    x = x.T if transpose else x
    x = (x / x.norm().clamp_min(1e-7)).bfloat16()
    for a, b, c in QUINTIC:  # a x + (b A + c A^2) x, A = x x^T, in the library's bf16 order
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, alpha=c, beta=b), x, beta=a)
    x = x.float()
    x = x.T if transpose else x
    return x * max(grad.shape) ** 0.5 * extra_scale


def _first_step_of_one_matrix(rank, world_size, raw):
    """(weight before step 1, its step-1 gradient, weight after) of layer 1's attention
    output projection, read by on_step hooks (the gradient buffer is zeroed only when step 2
    starts)."""
    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training.pretrain import pretrain

    seen = {}

    def on_step(step, trainer):
        name, param = next((n, p) for n, p in trainer.unwrapped()[0].named_parameters()
                           if "layers.0.self_attention.linear_proj.weight" in n)
        seen[step] = (param.detach().clone(), param.main_grad.detach().clone())

    run = config_from_dict(raw)
    pretrain(run, initialize_layout(run.parallel.layout(), timeout_s=60), on_step=on_step)
    return seen[1][0], seen[2][1], seen[2][0]


def test_muons_first_step_is_the_orthogonalised_gradient(text_tokens):
    """The trainer's first Muon step on a weight matrix equals the update written out
    (constant lr, no weight decay): W1 = W0 - lr * extra * sqrt(max(m, n)) * NS5(G)."""
    from harness import tiny_run

    from megatron_mvmoe.testing.spawn import run_distributed

    raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=2, eval_iters=0)
    raw["optimizer"] = dict(optimizer="muon", muon_extra_scale_factor=0.2, lr=0.01,
                            min_lr=0.01, lr_decay_style="constant", weight_decay=0.0,
                            use_distributed_optimizer=False)
    before, grad, after = run_distributed(_first_step_of_one_matrix, 1, args=(raw,),
                                          daemon=False)[0]
    expected = before - 0.01 * _naive_muon_update(grad, 0.2)
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-7)  # updates ~1e-3


def _layer_wise_muon_run(text_tokens, tmp_path, name, **optimizer):
    from harness import tiny_run

    raw = tiny_run(text_tokens, preset="tiny_smoe", train_iters=4, save_interval=2,
                   eval_iters=0, save=str(tmp_path / name))
    raw["optimizer"].update(optimizer="muon", muon_extra_scale_factor=0.2, **optimizer)
    raw["training"].update(precision="bf16")
    return raw


def test_layer_wise_muon_in_fp32_is_refused_naming_bf16():
    """Megatron-Core 0.19.2's layer-wise optimizer leaves fp32 optimizers unwrapped (its step
    then fails on prepare_grads): refused at resolution, naming both fixes."""
    from megatron_mvmoe.config.flags import config_from_args

    with pytest.raises(ValueError, match="LayerWiseDistributedOptimizer.*only in bf16.*"
                                         "add --bf16, or drop --use-distributed-optimizer"):
        config_from_args(MUON_LINE + ["--use-distributed-optimizer"]).validate()


@pytest.fixture(scope="module")
def replicated_muon_losses(text_tokens, tmp_path_factory):
    """Muon at DP 1 (replicated state), the reference of the layer-wise runs."""
    from harness import train

    return train(_layer_wise_muon_run(text_tokens, tmp_path_factory.mktemp("dp1"), "ck",
                                      use_distributed_optimizer=False), 1)["losses"]


def test_layer_wise_muon_at_dp2_equals_muon_at_dp1_and_resumes_exactly(
        tmp_path, text_tokens, replicated_muon_losses):
    """Megatron-Core's LayerWiseDistributedOptimizer at DP 2 with the shard-aligned layout
    (each rank updates whole matrices; Adam's share under the distributed optimizer) trains
    replicated Muon's losses within 1e-5; a resume from its step-2 checkpoint repeats steps
    3-4 bit for bit."""
    from harness import train

    raw = _layer_wise_muon_run(text_tokens, tmp_path, "lw", use_distributed_optimizer=True)
    full = train(raw, 2)["losses"]
    torch.testing.assert_close(full, replicated_muon_losses, rtol=1e-5, atol=0)
    raw["training"].update(load=str(tmp_path / "lw"), ckpt_step=2, save=str(tmp_path / "lw2"))
    assert train(raw, 2)["losses"] == full[2:]


def test_layer_wise_muons_legacy_path_at_dp2_equals_muon_at_dp1(tmp_path, text_tokens,
                                                                replicated_muon_losses):
    """--no-use-layer-wise-param-layout: one unsharded buffer, the updated matrices
    all-gathered in unequal per-rank sizes (gloo: platform/cpu_uneven_gather.py)."""
    from harness import train

    raw = _layer_wise_muon_run(text_tokens, tmp_path, "legacy", use_distributed_optimizer=True,
                               use_layer_wise_param_layout=False)
    torch.testing.assert_close(train(raw, 2)["losses"], replicated_muon_losses, rtol=1e-5,
                               atol=0)
