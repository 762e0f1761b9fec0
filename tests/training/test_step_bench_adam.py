"""training/step_bench.py's bare step against the trainer runs torch AdamW's default
implementation (what Megatron-Core builds) instead of foreach: on CPU the two are the same
update bit for bit, so the choice changes only the bare step's speed."""

import torch


def _adamw_params(foreach, steps=3):
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=gen).requires_grad_()
              for shape in ((64, 32), (32,), (4, 16, 8))]
    optimizer = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.1, foreach=foreach)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
    return params


def test_default_adamw_equals_foreach_bit_for_bit():
    for default, foreach in zip(_adamw_params(None), _adamw_params(True)):
        assert torch.equal(default, foreach)
