"""The gradient norm computed once per step, not twice (issue 42 item 3: a thin trainer).

The step (training/step.py) needs the norm BEFORE the update, for its NaN/inf verdict; then
Megatron-Core's `ChainedOptimizer.step()` computes it again (`self.get_grad_norm()`) to clip:
a second pass over every gradient and, with data parallelism, a second all-reduce. Between
the two nothing changes the gradients (`prepare_grads()` without a loss scaler only copies
model grads into main grads again, the same values; step.py reuses the norm only without a scaler), so
the second result is the first one, bit for bit.

Design choices:
- The seam is the optimizer's own method: for the duration of `step()` the instance's
  `get_grad_norm` returns the value the verdict computed (an instance attribute shadows the
  class method; removed afterwards, also on error). Megatron-Core's code runs unmodified.
- A probe decides where it applies: only where the optimizer's `step` calls
  `self.get_grad_norm()` (ChainedOptimizer, what `get_megatron_optimizer` returns for Adam
  and SGD). Elsewhere (an optimizer whose step computes its norm inside `clip_grad_norm`)
  nothing is shadowed and the norm is computed twice, as before: slower, never wrong.
- Measured at issue 42's smoe shape (15.7 M parameters, one thread): half the trainer's
  `linalg_vector_norm` calls and ~5 ms of a ~0.8 s step (`tools/profile_step.py --step
  trainer`); tests/training/test_grad_norm_once.py checks one norm per step and the same
  losses as the two-norm step.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from typing import Iterator


def step_reads_own_grad_norm(optimizer) -> bool:
    """True when `optimizer.step()` takes its clipping norm from `self.get_grad_norm()`."""
    return _step_reads_own_grad_norm(type(optimizer))


@functools.lru_cache(maxsize=None)
def _step_reads_own_grad_norm(optimizer_type: type) -> bool:
    """Per class, once: reading the source every step would put it on the step's path."""
    try:
        return "self.get_grad_norm()" in inspect.getsource(optimizer_type.step)
    except (OSError, TypeError):
        return False


@contextmanager
def grad_norm_reused(optimizer, grad_norm) -> Iterator[None]:
    """Within the block, `optimizer.get_grad_norm()` returns `grad_norm` (the value it
    returned for these same gradients) where the optimizer's step reads it; see above."""
    if not step_reads_own_grad_norm(optimizer) or "get_grad_norm" in vars(optimizer):
        yield
        return
    optimizer.get_grad_norm = lambda: grad_norm
    try:
        yield
    finally:
        del optimizer.get_grad_norm
