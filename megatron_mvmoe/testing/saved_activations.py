"""Bytes autograd keeps for the backward after a model's forward: `SavedActivations`.

Why: resident-set peaks (training/memory_report.py) include the allocator's and the
libraries' transients; what activation recompute changes is exactly the set of tensors
saved for the backward. This counts them through `torch.autograd.graph.saved_tensors_hooks`
while the model's forward runs (a forward pre-hook / hook pair marks it), each storage once,
parameters' storages excluded (weights saved by a linear are not activations), so a
recompute's second forward inside the backward is not counted. Tests compare it with
the planner's per-microbatch activations (planning/memory.py).
"""

from __future__ import annotations

from typing import Dict

import torch


class SavedActivations:
    """Context manager: `with SavedActivations(model) as saved: <forward + backward>`;
    then `saved.bytes_per_forward()` is the mean over the forwards it saw."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.forwards: list = []
        self._current: Dict[int, int] = {}
        self._active = False
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def _pack(self, tensor: torch.Tensor):
        if self._active:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self._params:
                self._current[storage.data_ptr()] = storage.nbytes()
        return tensor

    def _start(self, *args):
        self._active, self._current = True, {}

    def _end(self, *args):
        self._active = False
        self.forwards.append(sum(self._current.values()))

    def __enter__(self) -> "SavedActivations":
        self._handles = [self.model.register_forward_pre_hook(self._start),
                         self.model.register_forward_hook(self._end)]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()

    def bytes_per_forward(self) -> float:
        assert self.forwards, "no forward ran inside the context"
        return sum(self.forwards) / len(self.forwards)
