"""Whether torch.compile's inductor backend builds working CPU code in this process.

Megatron-Core's elementwise fusions (`megatron.core.fusions`, e.g. `bias_swiglu_impl`) are
its `jit_fuser`, which is `torch.compile` on torch >= 2.2: Triton on a GPU, inductor's C++
backend on CPU. The C++ backend needs a working compiler and Python headers; where it
fails, a fused function would raise at its first call, deep inside a forward. So the
CPU fast-path rule (models/fast_paths.py) asks this probe first and, where it fails, keeps
the eager functions and says why on the start-up banner.

Design choices:
- One real compile of a tiny SiLU-times-input, forward and backward, compared with eager:
  what the fusions need, not a guess from `shutil.which("g++")`.
- Once per process (functools.cache): the first process on a machine pays the C++ compile
  (seconds); later ones hit inductor's on-disk cache.
- Called only where a fusion would run on CPU (the SwiGLU rule asks it last, through a
  `Target(probe_inductor=True)` from models/provider.py `target_for`), so tiny test models
  never compile, nor does tools/plan.py without --probe-inductor.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _silu_times_input(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) * x


@functools.cache
def inductor_blocker() -> str:
    """'' where a torch.compile'd elementwise function runs here, forward and backward, and
    equals eager; else why not (one line, for the banner)."""
    x = torch.linspace(-2.0, 2.0, 16, requires_grad=True)
    try:
        fused = torch.compile(_silu_times_input, dynamic=False)
        y = fused(x)
        (grad,) = torch.autograd.grad(y.sum(), x)
    except Exception as err:  # the compiler, its headers, a torch build without inductor
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return f"torch.compile (inductor C++) fails here: {type(err).__name__}: {first[:160]}"
    eager_x = x.detach().requires_grad_()
    (eager_grad,) = torch.autograd.grad(_silu_times_input(eager_x).sum(), eager_x)
    if not (torch.allclose(y, _silu_times_input(x)) and torch.allclose(grad, eager_grad)):
        return "torch.compile (inductor C++) gives results unlike eager here"
    return ""
