"""Which implementation a kernel call uses: the Triton kernel or the pure-torch reference.

Design choices:
- One switch for every kernel: the `backend=` argument, else the MVMOE_KERNELS environment
  variable (triton | reference | auto), else auto. Auto picks Triton for CUDA tensors when
  triton is installed and the reference everywhere else. The variable is read at call time
  (no module state), so a test or a job can flip it without re-importing anything.
- Triton is optional (setup.py extra "kernels"): nothing here imports it at module import.
- Triton decides compiled-vs-interpreted when a function is DECORATED (TRITON_INTERPRET is
  read by `triton.jit`), so a module of decorated kernels imported before the variable is set
  stays compiled forever. We therefore keep kernel bodies undecorated and decorate them at
  first use, once per mode (`jit_for`): CPU tensors get the interpreter, CUDA tensors the
  compiler, in the same process and whatever the import order.
- CPU Triton (the interpreter) is opt-in: it needs TRITON_INTERPRET=1, as Triton documents,
  and is meant for tests; it is far too slow for training.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Callable, Dict, NamedTuple, Optional, Tuple

import torch

ENV_VAR = "MVMOE_KERNELS"
BACKENDS = ("auto", "triton", "reference")


def triton_available() -> bool:
    """True when the triton package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET asks for the Triton CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def resolve_backend(requested: Optional[str], device: torch.device) -> str:
    """The backend a call on `device` runs: "triton" or "reference".

    Args:
        requested: "auto", "triton", "reference", or None to read MVMOE_KERNELS (default auto).
        device: device of the call's tensors.

    Raises:
        ValueError: unknown backend name, or "triton" asked where it cannot run.
    """
    source = "backend" if requested is not None else ENV_VAR
    choice = (requested if requested is not None else os.environ.get(ENV_VAR, "auto"))
    choice = choice.strip().lower()
    if choice not in BACKENDS:
        raise ValueError(
            f"{source}: unknown kernel backend {choice!r}. Fix: use one of {', '.join(BACKENDS)}")
    if choice == "reference":
        return "reference"
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "reference"
    if not triton_available():
        raise ValueError(
            f"{source}=triton but the triton package is not installed. Fix: pip install triton "
            "(setup.py extra 'kernels') or use the reference backend")
    if device.type != "cuda" and not interpreter_enabled():
        raise ValueError(
            f"{source}=triton on {device.type} tensors needs the Triton interpreter. Fix: set "
            "TRITON_INTERPRET=1 (tests only; it is slow) or use the reference backend")
    return "triton"


def backend_at_build(requested: str) -> str:
    """The backend a module built now runs for its whole life: `requested` ("auto" defers to
    MVMOE_KERNELS) on this process's device (CUDA when present, else the CPU), resolved once
    so a bad name or an impossible "triton" fails at build, not in the first forward.

    Raises:
        ValueError: as `resolve_backend`.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return resolve_backend(None if requested == "auto" else requested, device)


class KernelLaunch(NamedTuple):
    """One kernel call as a launcher builds it: run by `launch`, or compiled ahead of time for
    a GPU target by aot.py from the very same arguments (so the two cannot drift apart)."""

    kernel_fn: Callable  # the undecorated body (decorated per mode by jit_for)
    grid: Tuple[int, ...]
    args: Tuple[Any, ...]  # positional runtime arguments: tensors and scalars
    constexprs: Dict[str, Any]  # compile-time parameters, by name


def _release(version: str) -> Tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:2])


def interpreter_loop_refusal(triton_version: Optional[str] = None,
                             numpy_version: Optional[str] = None) -> Optional[str]:
    """Why the Triton CPU interpreter cannot run a loop over a runtime size here, or None.
    Triton < 3.7's interpreter turns such a bound into an int with int() of a 1-element
    array, which numpy >= 2.5 refuses (TypeError deep in the interpreter); Triton 3.7
    squeezes it first. Compiled (CUDA) kernels are unaffected. Versions default to the
    installed ones."""
    if triton_version is None:
        import numpy
        import triton
        triton_version, numpy_version = triton.__version__, numpy.__version__
    if _release(triton_version) >= (3, 7) or _release(numpy_version) < (2, 5):
        return None
    return (f"the Triton {triton_version} CPU interpreter cannot run this kernel's loop over "
            f"a runtime size with numpy {numpy_version}. Fix: triton >= 3.7 or numpy < 2.5 "
            "for interpreted kernels, or the reference backend (GPU runs are unaffected)")


def launch(call: KernelLaunch, device: torch.device) -> None:
    """Run `call` on `device` (compiled on CUDA, interpreted on CPU)."""
    jit_for(call.kernel_fn, device)[call.grid](*call.args, **call.constexprs)


def jit_for(kernel_fn: Callable, device: torch.device):
    """`kernel_fn` decorated with triton.jit for `device`: interpreted on CPU, compiled on CUDA."""
    return _decorate(kernel_fn, device.type != "cuda")


@functools.lru_cache(maxsize=None)
def _decorate(kernel_fn: Callable, interpret: bool):
    # A memo of decorated functions (Triton keeps its compile cache on these objects);
    # the knob is scoped so the process-wide TRITON_INTERPRET setting is left untouched.
    import triton
    from triton import knobs

    with knobs.runtime.scope():
        knobs.runtime.interpret = interpret
        return triton.jit(kernel_fn)
