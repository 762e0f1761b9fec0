"""Megatron's CUDA RNG tracker on CPU: its states are the CPU generator's (a platform patch
registered in cpu_patches.ALL_PATCHES, probed by rng_tracker_breaks)."""

from __future__ import annotations

import importlib
import logging

import torch


def cpu_rng_tracker() -> None:
    """The CUDA RNG tracker (used by attention/dropout forks) saves, reseeds and restores
    the CPU generator, so weight init and forks follow the same order as on a GPU.

    Its fork() also warns "CPU RNG state changed within GPU RNG context" when the CPU
    generator moved inside a fork: on a GPU that catches CPU randomness drawn where CUDA's
    was meant. Here the fork's stream IS the CPU generator, so every fork that draws
    (dropout) moves it by construction and the check cannot hold: the warning printed on
    every layer of every step. This patch makes the streams one, so it drops that one
    message of that logger (tests/platform/test_cpu_patches.py)."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state())
    random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: (
        torch.set_rng_state(new_state))
    logger = logging.getLogger(random.__name__)
    if not any(isinstance(f, _ForkOnTheCpuGenerator) for f in logger.filters):
        logger.addFilter(_ForkOnTheCpuGenerator())


class _ForkOnTheCpuGenerator(logging.Filter):
    """Drops fork()'s CPU-RNG-changed warning, which holds by construction on CPU (above)."""

    MESSAGE = "CPU RNG state changed within GPU RNG context"

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.MESSAGE


def rng_tracker_breaks() -> bool:
    """Unpatched, setting a state is deferred to a CUDA init that never comes (a silent
    no-op), so the tracker would never restore the generator after a fork."""
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    state = torch.get_rng_state()
    torch.rand(1)
    try:
        random._set_cuda_rng_state(state)
    except (AssertionError, RuntimeError, AttributeError):
        return True
    restored = torch.equal(torch.get_rng_state(), state)
    torch.set_rng_state(state)
    return not restored
