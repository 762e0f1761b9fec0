"""CPU stand-ins for the `torch.cuda` calls Megatron-Core 0.19.2 makes directly (a CPU
patch registered in cpu_patches.PATCHES, probed by `_torch_cuda_breaks`).

Applied only when CUDA is absent: streams and events are no-ops (CPU kernels run
synchronously), `current_device()` answers "cpu" so that
`device=torch.cuda.current_device()` places tensors on the CPU, and `device_count()`
answers 1 so seed set-up behaves like a one-GPU host.
"""

from __future__ import annotations

import contextlib

import torch

from megatron_mvmoe.platform.patch import Patch


class _CpuStream:
    """A CUDA stream stand-in: CPU kernels are synchronous, so ordering is a no-op."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other) -> bool:
        return isinstance(other, _CpuStream)

    def __hash__(self) -> int:
        return 0


class _CpuEvent:
    """A CUDA event stand-in (recorded work on CPU is always complete)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CPU_STREAM = _CpuStream()


def _shim_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.device_count = lambda: 1
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    cuda.current_stream = lambda device=None: _CPU_STREAM
    cuda.default_stream = lambda device=None: _CPU_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.synchronize = lambda device=None: None
    cuda.set_device = lambda device: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.set_rng_state = cuda.set_rng_state
    # The "CUDA" generator Megatron seeds and forks is the CPU generator here.
    # (torch.manual_seed itself calls cuda.manual_seed_all, so that one stays a no-op.)
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: None
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    cuda.max_memory_reserved = lambda device=None: 0
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.empty_cache = lambda: None
    # the CUDA build of torch (PyPI's only cp312 wheel) raises "driver insufficient" here
    cuda.is_current_stream_capturing = lambda: False
    cuda.nvtx.range_push = lambda msg: None
    cuda.nvtx.range_pop = lambda: None


def _torch_cuda_breaks() -> bool:
    try:
        torch.empty(1, device=torch.cuda.current_device())
        torch.cuda.Stream()
        torch.cuda.is_current_stream_capturing()  # Megatron's router trace hook asks
        return False
    except (AssertionError, RuntimeError):
        return True


TORCH_CUDA_STAND_INS = Patch(
    "torch.cuda stand-ins",
    "Megatron calls torch.cuda.current_device/Stream/current_stream/synchronize/"
    "get_rng_state/is_current_stream_capturing and nvtx directly (router, experts, "
    "dispatcher, p2p, random, router trace).",
    _shim_torch_cuda, _torch_cuda_breaks)
