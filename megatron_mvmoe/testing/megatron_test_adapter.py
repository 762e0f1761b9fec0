"""pytest plugin that lets Megatron-LM's own (GPU-written) unit tests run on this CPU platform.

Loaded by tools/megatron_moe_tests.py into a pytest session over an extracted Megatron-LM
tests/ tree (environment variable MVMOE_MEGATRON_TESTS_ROOT names that tree). It changes
what the *tests' own code* sees and nothing that Megatron-Core sees: Megatron-Core runs
unmodified except for our platform layer (megatron_mvmoe/platform/cpu_patches.py), so a
Megatron-internal `.cuda()` or `device="cuda"` still fails and shows a platform gap.

Design choices:
- The platform layer is applied first, at plugin load, before any test module imports
  Megatron (the same order as our trainer).
- Modules under the tests root get a module-local `torch` (an import hook keyed on the
  importing module's `__file__`): `torch.cuda.is_available()` answers True there, so
  `skipif(not torch.cuda.is_available())` tests run on the CPU "device", and factory
  calls with `device="cuda"` build CPU tensors. Megatron's modules keep the real torch.
- `Tensor.cuda()/.to("cuda")` and `Module.cuda()/.to("cuda")` called from a frame in a
  test file stay on the CPU; called from anywhere else they behave as torch does.
- The tests' distributed init asks for NCCL; on a machine without CUDA it gets gloo.
- Outcomes of every test phase go to a JSON-lines file (MVMOE_MEGATRON_TESTS_REPORT) with
  the first line of the error, so the tool can group failures by cause.
"""

from __future__ import annotations

import builtins
import functools
import json
import os
import sys
import types
from typing import Any, Optional

import torch

TESTS_ROOT_ENV = "MVMOE_MEGATRON_TESTS_ROOT"
REPORT_ENV = "MVMOE_MEGATRON_TESTS_REPORT"
PG_TIMEOUT_ENV = "MVMOE_MEGATRON_TESTS_PG_TIMEOUT_S"

_FACTORIES = frozenset((
    "zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "linspace", "eye",
    "rand", "randn", "randint", "randperm", "normal", "zeros_like", "ones_like",
    "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "empty_strided",
))


def _is_cuda_device(device: Any) -> bool:
    return device is not None and not isinstance(device, bool) and "cuda" in str(device)


def _cpu_device_kwargs(kwargs: dict) -> dict:
    if _is_cuda_device(kwargs.get("device")):
        return dict(kwargs, device="cpu")
    return kwargs


class _TestCuda(types.ModuleType):
    """`torch.cuda` as the tests see it: the CPU is their CUDA device."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    def __getattr__(self, name: str):
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available() -> bool:
        return True


class _TestTorch(types.ModuleType):
    """`torch` as the tests see it: factories place `device="cuda"` tensors on the CPU."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.__dict__["cuda"] = _TestCuda()

    def __getattr__(self, name: str):
        attr = getattr(torch, name)
        if name in _FACTORIES:
            return functools.partial(_factory_on_cpu, attr)
        return attr


def _factory_on_cpu(factory, *args, **kwargs):
    return factory(*args, **_cpu_device_kwargs(kwargs))


_TEST_TORCH = _TestTorch()


def _tests_root() -> str:
    root = os.environ.get(TESTS_ROOT_ENV)
    if not root:
        raise RuntimeError(f"{TESTS_ROOT_ENV} is not set. Fix: run Megatron's tests through "
                           "tools/megatron_moe_tests.py, which sets it")
    return os.path.realpath(root) + os.sep


@functools.lru_cache(maxsize=4096)
def _in_tests(filename: Optional[str], root: str) -> bool:
    """Cached: `.to()` is called by Megatron's hot paths too."""
    return bool(filename) and os.path.realpath(filename).startswith(root)


def _install_import_hook(root: str) -> None:
    """`import torch` inside a module under the tests root binds the tests' torch."""
    original_import = builtins.__import__

    def import_for_tests(name, globals=None, locals=None, fromlist=(), level=0):
        module = original_import(name, globals, locals, fromlist, level)
        if module is torch and level == 0 and globals and _in_tests(
                globals.get("__file__"), root):
            return _TEST_TORCH
        return module

    builtins.__import__ = import_for_tests


def _caller_in_tests(root: str) -> bool:
    return _in_tests(sys._getframe(2).f_code.co_filename, root)


def _cpu_to_args(args: tuple, kwargs: dict):
    args = tuple("cpu" if _is_cuda_device(a) else a for a in args)
    return args, _cpu_device_kwargs(kwargs)


def _cuda_for_tests(original, root: str):
    """`.cuda()` that keeps the object where it is when test code calls it."""
    def cuda(self, *args, **kwargs):
        if _caller_in_tests(root):
            return self
        return original(self, *args, **kwargs)

    return cuda


def _to_for_tests(original, root: str):
    """`.to(...)` that maps a CUDA device to the CPU when test code calls it."""
    def to(self, *args, **kwargs):
        if _caller_in_tests(root):
            args, kwargs = _cpu_to_args(args, kwargs)
        return original(self, *args, **kwargs)

    return to


def _install_device_methods(root: str) -> None:
    """`.cuda()` / `.to("cuda")` from test code keep tensors and modules on the CPU."""
    for cls in (torch.Tensor, torch.nn.Module):
        cls.cuda = _cuda_for_tests(cls.cuda, root)
        cls.to = _to_for_tests(cls.to, root)


def _install_gloo_for_nccl() -> None:
    """Megatron's test Utils initialise NCCL; without CUDA the same world runs on gloo.
    A collective left waiting by a failed peer rank gives up after the per-test timeout
    (gloo's default is 30 min), so one failure costs one test, not the file."""
    dist = torch.distributed
    original = dist.init_process_group
    timeout_s = float(os.environ.get(PG_TIMEOUT_ENV, "0"))

    @functools.wraps(original)
    def init_process_group(backend=None, *args, **kwargs):
        if backend is not None and "nccl" in str(backend):
            backend = "gloo"
        if timeout_s > 0 and "timeout" not in kwargs:
            import datetime

            kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
        return original(backend, *args, **kwargs)

    dist.init_process_group = init_process_group


def install(root: Optional[str] = None) -> None:
    """Platform layer, then the test-side adapter (idempotent per process)."""
    if getattr(torch, "_mvmoe_test_adapter", False):
        return
    from megatron_mvmoe.platform import apply_cpu_patches

    apply_cpu_patches()
    root = root or _tests_root()
    _install_import_hook(root)
    _install_device_methods(root)
    _install_gloo_for_nccl()
    torch._mvmoe_test_adapter = True


# ------------------------------------------------------------------ pytest hooks
def _first_error_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).strip().splitlines()[0][:300] if crash.message else ""
    if isinstance(report.longrepr, tuple):  # skip: (path, line, reason)
        return str(report.longrepr[2])[:300]
    return str(report.longrepr).strip().splitlines()[-1][:300] if report.longrepr else ""


def _append_report(row: dict) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(row) + "\n")


def pytest_collection_finish(session) -> None:
    _append_report({"collected": [item.nodeid for item in session.items]})


def pytest_collectreport(report) -> None:
    """A file that fails to import is one failure, with its error."""
    if report.failed:
        _append_report({"nodeid": report.nodeid, "when": "collect", "outcome": "failed",
                        "error": _first_error_line(report), "duration_s": 0.0})


def pytest_unconfigure(config) -> None:
    """A test that initialised torch.distributed without tearing it down would leave the
    ranks waiting on each other at interpreter exit (Megatron's conftest tears down its
    own; a file without that fixture would hang until the tool kills it)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def pytest_runtest_logreport(report) -> None:
    if report.when != "call" and report.outcome == "passed":
        return
    row = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
           "error": "" if report.outcome == "passed" else _first_error_line(report),
           "duration_s": round(report.duration, 3)}
    _append_report(row)
