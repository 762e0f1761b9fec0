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
    got = optimizer_config(run, SimpleNamespace(bf16=False, params_dtype=torch.float32))
    assert (got.optimizer, got.muon_momentum, got.muon_extra_scale_factor,
            got.muon_scale_mode) == ("muon", 0.9, 0.2, "spectral")


@pytest.mark.parametrize("line", [MUON_LINE + ["--use-distributed-optimizer"],
                                  ["--model-preset", "tiny_smoe", "--optimizer", "dist_muon"]])
def test_muon_with_a_distributed_optimizer_is_refused_naming_the_fix(line):
    """Megatron-LM runs that as LayerWiseDistributedOptimizer, which is not wired here."""
    from megatron_mvmoe.config.flags import config_from_args

    with pytest.raises(ValueError, match="LayerWiseDistributedOptimizer.*without "
                                         "--use-distributed-optimizer"):
        config_from_args(line).validate()


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
