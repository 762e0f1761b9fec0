"""training/step_bench.py's bare step against the trainer runs torch AdamW's default
implementation (what Megatron-Core builds) instead of foreach: on CPU the two are the same
update bit for bit, so the choice changes only the bare step's speed. The same holds for
optimizer.torch_adam_impl's for_loop and foreach (docs/megatron_lm.md); fused is not promised
to."""

import torch

from megatron_mvmoe.training.adam_impl import IMPL_FLAGS


def _adamw_params(impl, steps=3):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen).requires_grad_()
              for shape in ((64, 32), (32,), (4, 16, 8))]
    foreach, fused = IMPL_FLAGS[impl]
    optimizer = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.1, foreach=foreach, fused=fused)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return params


def test_default_adamw_equals_for_loop_and_foreach_bit_for_bit():
    default = _adamw_params("default")
    for impl in ("for_loop", "foreach"):
        assert all(torch.equal(a, b) for a, b in zip(_adamw_params(impl), default)), impl
