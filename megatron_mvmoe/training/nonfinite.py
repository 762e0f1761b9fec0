"""Name the step and the first layer whose output went non-finite when a step's loss or
gradient norm is NaN/inf (step.py decides that on all ranks before the update).

Design choices:
- Forward hooks on every TransformerLayer (and the embedding / final norm) OR a
  "non-finite seen" flag into a tensor without a host sync; the flags are read only when
  the loss is already non-finite, so a healthy step pays one reduction per layer.
- The first bad module is the one with the smallest global layer number among those that
  flagged (gathered over all ranks): later layers go non-finite because earlier ones did.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core.transformer.transformer_layer import TransformerLayer


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or inf."""


def _first_tensor(output):
    if torch.is_tensor(output):
        return output
    if isinstance(output, (tuple, list)):
        for item in output:
            if torch.is_tensor(item):
                return item
    return None


class NonFiniteWatch:
    """Per-layer flags: did this layer emit a non-finite value since the last reset?"""

    def __init__(self, chunks: List[torch.nn.Module]) -> None:
        self.flags: Dict[Tuple[int, str], torch.Tensor] = {}
        self.handles = []
        for chunk in chunks:
            for name, module in chunk.named_modules():
                if isinstance(module, TransformerLayer):
                    self._watch(module, int(module.layer_number), name)
                elif name.endswith("embedding") and name.count(".") == 0:
                    self._watch(module, 0, name)

    def _watch(self, module: torch.nn.Module, order: int, name: str) -> None:
        key = (order, name)

        def hook(mod, args, output):
            tensor = _first_tensor(output)
            if tensor is None or not tensor.is_floating_point():
                return
            bad = ~torch.isfinite(tensor.detach()).all()
            flag = self.flags.get(key)
            self.flags[key] = bad if flag is None else (flag | bad)

        self.handles.append(module.register_forward_hook(hook))

    def reset(self) -> None:
        self.flags.clear()

    def first_bad_local(self) -> Optional[Tuple[int, str]]:
        bad = [key for key, flag in self.flags.items() if bool(flag)]
        return min(bad) if bad else None

    def first_bad_global(self) -> Optional[str]:
        """Collective: the earliest non-finite layer over all ranks, as a readable name."""
        local = self.first_bad_local()
        gathered: List[Optional[Tuple[int, str]]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        found = [g for g in gathered if g is not None]
        if not found:
            return None
        order, name = min(found)
        return f"{name} (layer {order})" if order else name

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def nonfinite_error(loss: float, grad_norm: float, step: int,
                    watch: Optional[NonFiniteWatch], last_checkpoint: Optional[str]
                    ) -> NonFiniteLoss:
    """The error for a non-finite step (collective when `watch` is given: it gathers the
    first bad layer). The update was not applied, so the weights are still finite."""
    where = watch.first_bad_global() if watch is not None else None
    detail = (f"; first non-finite output: {where}" if where
              else "; every layer output was finite (the loss, LM head or backward overflowed)")
    kept = (f"the weights were not updated and {last_checkpoint} holds finite weights"
            if last_checkpoint else "the weights were not updated")
    return NonFiniteLoss(f"training loss is {loss}, grad norm {grad_norm} at step {step}"
                         f"{detail}; {kept}. Fix: lower --lr, check the data, or pass "
                         "--skip-nonfinite to skip such updates")
