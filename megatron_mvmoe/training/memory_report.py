"""What a run actually holds in memory, per rank and by category, written to
<run_dir>/memory/rank<R>.json so that `tools/plan.py --validate RUN_DIR` can set the
planner's prediction against it; and the start-up check that a run fits at all.

Categories measured (bytes of the tensors actually allocated, each storage counted once):
- params: the storages behind the model's parameters (with the distributed optimizer,
  Megatron's contiguous `param_data` buffers, padding included);
- grads: the storages behind every `param.main_grad` (DDP's `grad_data` buffers);
- optimizer: every tensor in the torch optimizers' states (exp_avg, exp_avg_sq, step) and
  every main parameter that is not a view of a model parameter (the fp32 master shards of a
  bf16 model);
- runtime: resident memory before the model was built (interpreter, torch, Megatron, data);
- per step: the resident-set high-water mark of that step (VmHWM, reset after each step
  through /proc/self/clear_refs) and the resident set when it began, so that
  activations = peak - resident at the start of a plain training step, and a save step's
  extra over a plain step is the checkpoint transient;
- per step and phase (the step's `phase_hook`): the high-water mark of the forward/backward
  ("backward"), of the gradient norm + optimizer step + parameter all-gather ("optimizer")
  and of the rest (scheduler, save), each with the resident set at the phase's end, so
  the optimizer step's transient (its peak over the resident set after the backward) is
  measured apart from the activations.

Design choices:
- One call from pretrain (`memory_hook`), which wraps its `on_step`: the hook is called before
  each step with the trainer, so it needs nothing else from the loop. The fit check runs in
  the same call, before the trainer is built (nothing allocated yet).
- The peak is the kernel's (VmHWM), not torch's: on CPU the glibc allocator returns large
  blocks to the system, so resident memory follows the live tensors plus what the libraries
  hold, which is what runs out.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Dict, Iterable, List, Optional

import torch
from torch.distributed.tensor import DTensor

from megatron_mvmoe.platform.resident_memory import (available_bytes, peak_rss_bytes,
                                                     reset_peak_rss, rss_bytes)
from megatron_mvmoe.checkpointing.integrity import write_json_atomic
from megatron_mvmoe.config.run_dir import memory_record_path

SKIP_CHECK_ENV = "MVMOE_MEMORY_CHECK"
"""Set to "off" to skip the start-up fit check (e.g. when the memory of other jobs on the
node is about to be freed)."""


# --------------------------------------------------------------------- tensor census
def _storages(tensors: Iterable[torch.Tensor], seen: set) -> int:
    """Bytes of the storages behind `tensors` not yet in `seen` (adds them)."""
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        if isinstance(t, DTensor):  # Megatron-FSDP's sharded params: this rank's shard
            t = t.to_local()
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _torch_optimizers(optimizer) -> List[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's (Chained)(Distributed)Optimizer."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [o for c in chained for o in _torch_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def tensor_census(model_chunks: List[torch.nn.Module], optimizer) -> Dict[str, int]:
    """Bytes by category of what this rank holds (see the module docstring)."""
    seen: set = set()
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    out = {"params": _storages(params, seen),
           "params_numel": sum(p.numel() for p in params),
           "grads": _storages((getattr(p, "main_grad", None) for p in params), seen)}
    out["grads"] += _storages((p.grad for p in params), seen)
    opt_tensors = []
    for opt in _torch_optimizers(optimizer):
        opt_tensors += [p for group in opt.param_groups for p in group["params"]]
        opt_tensors += [v for state in opt.state.values() for v in state.values()]
    out["optimizer"] = _storages(opt_tensors, seen)
    out["module_buffers"] = _storages((b for c in model_chunks for b in c.buffers()), seen)
    return out


# ------------------------------------------------------------------------------ hook
class MemoryRecorder:
    """Called before each step: records the census once the optimizer states exist (before
    the second step of the call), and each finished step's resident peak; rewrites
    rank<R>.json every step."""

    def __init__(self, run, rank: int, layout_ranks: Dict[str, int]) -> None:
        self.run, self.rank = run, rank
        self.record: Dict = {"rank": rank, **layout_ranks, "runtime_rss": rss_bytes(),
                             "peak_reset_supported": reset_peak_rss(), "steps": []}
        self.step_start_rss: Optional[int] = None
        self.phases: Dict[str, Dict[str, int]] = {}
        self.created = self.step_started = time.perf_counter()

    def end_phase(self, phase: str) -> None:
        """The step's phase hook: this phase's peak and the resident set at its end; the
        next phase's peak starts from here."""
        self.phases[phase] = {"peak_rss": peak_rss_bytes(), "end_rss": rss_bytes()}
        reset_peak_rss()

    def __call__(self, step: int, trainer) -> None:
        if "after_build_rss" not in self.record:  # the first step of this call (a resume's > 1)
            import torch.distributed as dist

            # build + resume (--load) or warm start: a resumed run's extra is the load time
            self.record["seconds_to_first_step"] = time.perf_counter() - self.created
            self.record["after_build_rss"] = rss_bytes()
            self.record["bf16"] = bool(trainer.config.bf16)
            self.record["world_size"] = dist.get_world_size() if dist.is_initialized() else 1
            self.record["census_after_build"] = tensor_census(trainer.unwrapped(),
                                                              trainer.optimizer)
            trainer.phase_hook = self.end_phase
        else:
            self._finish_step(step - 1, trainer)
        reset_peak_rss()
        self.step_start_rss = rss_bytes()
        self.phases = {}
        self.step_started = time.perf_counter()

    def _finish_step(self, step: int, trainer) -> None:
        t = self.run.training
        rest = peak_rss_bytes()  # since the last phase's end (or the step's start)
        self.record["steps"].append({
            "step": step, "start_rss": self.step_start_rss,
            "peak_rss": max([rest] + [p["peak_rss"] for p in self.phases.values()]),
            "phases": dict(self.phases, rest={"peak_rss": rest, "end_rss": rss_bytes()}),
            "seconds": time.perf_counter() - self.step_started,  # a save step includes it
            "saved": t.save is not None and t.save_interval > 0 and step % t.save_interval == 0,
            "evaluated": t.eval_interval > 0 and step % t.eval_interval == 0})
        if "census" not in self.record:
            self.record["census"] = tensor_census(trainer.unwrapped(), trainer.optimizer)
        self._write()

    def _write(self) -> None:
        run_dir = self.run.logging.run_dir
        if run_dir is None:
            return
        path = memory_record_path(run_dir, self.rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json_atomic(path, self.record)


def _layout_ranks(pg_collection) -> Dict[str, int]:
    """This rank's place in each group of `pg_collection` (Megatron's ProcessGroupCollection)."""
    return {"pp_rank": pg_collection.pp.rank(), "ep_rank": pg_collection.ep.rank(),
            "tp_rank": pg_collection.tp.rank(), "dp_rank": pg_collection.dp.rank(),
            "expert_dp_rank": pg_collection.expt_dp.rank()}


def check_fits(run) -> None:
    """Collective: refuse a run whose planned resident memory (the CPU estimate of the
    busiest rank x the ranks on this node) exceeds what this node has available, before
    anything is allocated. Every rank raises the same error (the verdict is all-reduced)."""
    import torch.distributed as dist

    from megatron_mvmoe.planning.memory import fit_error

    if os.environ.get(SKIP_CHECK_ENV, "").lower() == "off" or not dist.is_initialized():
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    message = fit_error(run, dist.get_world_size(), local, available_bytes(), rss_bytes())
    verdict = torch.tensor([0.0 if message is None else 1.0])
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    if verdict.item() > 0:
        raise ValueError(message or "memory: another rank of this job found that the run "
                         "does not fit in the memory of its node (see its error line)")


def memory_hook(run, on_step: Optional[Callable], pg_collection) -> Callable:
    """pretrain's one call: check the fit, then return an `on_step` that records memory
    (and still calls the caller's `on_step`); ranks are read from `pg_collection`."""
    import torch.distributed as dist

    check_fits(run)
    recorder = MemoryRecorder(run, dist.get_rank() if dist.is_initialized() else 0,
                              _layout_ranks(pg_collection))

    def hook(step: int, trainer) -> None:
        recorder(step, trainer)
        if on_step is not None:
            on_step(step, trainer)

    return hook
