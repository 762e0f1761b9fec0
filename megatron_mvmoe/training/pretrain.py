"""Pretraining entry point: `python -m megatron_mvmoe.training.pretrain --config x.yaml [flags]`.

The loop, in order, each step:
  (once: resume from --load, or warm start from --warm-start-from) ->
  gamma ramp position -> forward/backward over the global batch (Megatron schedule,
  finalize_model_grads: DP sync + expert-bias update) -> optimizer + LR scheduler ->
  gamma ramp advance -> NaN/inf check (all ranks, same step) -> progress line, JSONL,
  TensorBoard, routing metrics -> per-domain evaluation -> checkpoint.

Design choices:
- `pretrain(run, pg_collection)` is a function of its inputs (no module-level state beyond
  Megatron's parallel state, which only the launcher initialises; every collective here
  runs on a group of `pg_collection`), so tests call it in-process on gloo ranks; `main()`
  (training/startup.py, re-exported here) adds the launcher: `launch.init_distributed`
  with the run's collective timeout (a dead rank makes the survivors fail within
  `distributed_timeout_seconds`), the run's `Start` (tokenizer, vocabulary, validated
  Megatron config: built once, the given RunConfig left unchanged) and
  `initialize_layout`.
- bf16 on GPU, fp32 on CPU (`training.precision = auto`).
- `on_step` (tests only) is called with (step, trainer) before each step, e.g. to corrupt
  a weight and check the NaN error.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch.distributed as dist

from megatron_mvmoe.checkpointing.directory import resolve_checkpoint
from megatron_mvmoe.checkpointing.integrity import write_json_atomic
from megatron_mvmoe.config.run_config import RunConfig
from megatron_mvmoe.data.batch_rampup import batch_calculator
from megatron_mvmoe.data.run_data import RunData
from megatron_mvmoe.platform.dist_ckpt_writer_queue import close_writer_processes
from megatron_mvmoe.training import checkpoint as ckpt
from megatron_mvmoe.training.a2a_metrics import A2AMonitor
from megatron_mvmoe.training.a2a_metrics import summary_line as a2a_summary_line
from megatron_mvmoe.training.build import Trainer, build_trainer
from megatron_mvmoe.training.gamma_ramp import gamma_advance
from megatron_mvmoe.training.memory_report import memory_hook
from megatron_mvmoe.training.metrics import (RoutingMonitor, RunLog, aux_losses,
                                             install_moe_metrics_tracker, mtp_losses,
                                             routing_summary)
from megatron_mvmoe.training.nonfinite import NonFiniteWatch, nonfinite_error
from megatron_mvmoe.training.rank_reports import recording
from megatron_mvmoe.training.run_info import Efficiency, write_run_files
from megatron_mvmoe.training.save_lock import hold_save_lock
from megatron_mvmoe.training.step import evaluate, train_step
from megatron_mvmoe.training.weight_hash_check import check_weight_hashes
from megatron_mvmoe.training.startup import Start, recover_saves, start_up
# The launcher lives in startup.py; `python -m megatron_mvmoe.training.pretrain` and its
# callers (tests, sbatch recipes) reach it here.
from megatron_mvmoe.training.startup import (USER_ERRORS, main, run_config,  # noqa: F401
                                             run_from_args)
from megatron_mvmoe.training.stopping import (STOPPED_MARKER, StopConditions, StopFlags,
                                              launcher_pid, marker_payload)
from megatron_mvmoe.training.warm_start import (check_target, has_checkpoint, warm_start,
                                                warm_start_lines)


@dataclass
class RunResult:
    """What a run returns (on every rank)."""

    losses: List[float] = field(default_factory=list)
    """Training loss of each step taken by this call (global-batch mean)."""
    first_step: int = 1
    eval: Dict[str, float] = field(default_factory=dict)
    """Final per-domain held-out loss."""
    tokens_per_second: float = 0.0
    last_checkpoint: Optional[str] = None
    stopped: Optional[str] = None
    """Why the run stopped before train_iters (signal, time budget, exit interval), or None."""
    skipped_iters: int = 0
    """Updates skipped over the whole run (resumes included) for a NaN/inf loss/grad norm, or
    an fp16 loss-scale overflow."""


class _Loop:
    """State of one pretraining call; methods are the named steps of an iteration."""

    def __init__(self, start: Start, pg_collection, on_step) -> None:
        run = start.run
        self.run, self.on_step = run, on_step
        self.trainer = build_trainer(run, pg_collection, start.config)
        world = dist.get_world_size()
        self.num_microbatches = run.num_microbatches(world)  # of the full global batch (eval)
        t, dp_group = run.training, pg_collection.dp
        self.batches = batch_calculator(t.rampup_batch_size, t.global_batch_size,
                                        t.micro_batch_size, dp_group.size(), dist.get_rank())
        self.window = {"samples": 0, "microbatches": 0}  # since the last progress line
        model = self.trainer.model_section
        self.data = RunData(run, model.seq_length, model.vocab_size, dp_group.rank(),
                            dp_group.size(), tokenizer=start.tokenizer)
        self.log = RunLog(run.logging.run_dir, run.logging.tensorboard, dist.get_rank() == 0,
                          tensorboard_dir=run.logging.tensorboard_dir,
                          wandb=run.logging if run.logging.wandb_project else None)
        self.efficiency = Efficiency(run, model, world,
                                     self.trainer.config.bf16)
        self.watch = NonFiniteWatch(self.trainer.unwrapped())
        self.routing = (RoutingMonitor(self.trainer.unwrapped(), model.num_experts, pg_collection)
                        if run.logging.routing_metrics and model.is_moe else None)
        self.a2a = A2AMonitor.for_run(run, self.trainer, pg_collection, self.log.line)
        self.advance_gamma = gamma_advance(self.trainer)
        install_moe_metrics_tracker()  # before the first forward records into it
        self.tracer = self._start_router_trace()
        self.state = ckpt.ResumeState()
        self.result = RunResult()
        self.stops = StopConditions(run.training.exit_duration_in_mins,
                                    run.training.exit_interval, launcher_pid())
        self.saver = ckpt.AsyncSaver() if run.training.async_save else None

    def resume(self) -> None:
        """--load (when it holds a checkpoint, or without a warm start), else the warm start."""
        t = self.run.training
        load = t.load
        recover_saves(self.run.training.save, self.log.line)
        if load is not None and _same_dir(load, t.save) and not has_checkpoint(load):
            # The requeue pattern: one command line for the first launch and every restart.
            self.log.line(f"--load {load}: no checkpoint yet (first launch of --save {t.save}): "
                          "starting fresh")
            load = None
        if load is None or (t.warm_start_from is not None and not has_checkpoint(load)):
            if t.warm_start_from is not None:
                self.warm_start()
            return
        self.state = ckpt.load_checkpoint(self.trainer, load, t.load_optimizer, t.ckpt_step,
                                          t.ckpt_allow_unverified, t.finetune)
        self.result.last_checkpoint = resolve_checkpoint(load, t.ckpt_step)
        self.log.line(f"resumed from {self.result.last_checkpoint} at step "
                      f"{self.state.step} (consumed samples {self.state.consumed_samples})")

    def already_saved(self, steps_taken: int) -> bool:
        """Resumed from this very step's checkpoint in --save and took no step (a finished
        run launched again): saving it again would only rewrite it."""
        save, loaded = self.run.training.save, self.result.last_checkpoint
        if steps_taken or save is None or loaded is None:
            return False
        name = f"iter_{self.state.step:07d}"
        if os.path.realpath(loaded) != os.path.realpath(os.path.join(save, name)):
            return False
        self.log.line(f"step {self.state.step} is already saved in {loaded} (resumed from "
                      "it, no step taken): not saving it again")
        return True

    def warm_start(self) -> None:
        t = self.run.training
        reports = warm_start(self.trainer, t.warm_start_from, t.warm_start_new_heads)
        for line in warm_start_lines(reports, t, self.trainer.model_section):
            self.log.line(line)

    def _start_router_trace(self):
        """Megatron's router trace (`--moe-routing-trace-path`), MultiRouter included."""
        lg = self.run.logging
        if lg.moe_routing_trace_path is None or not self.trainer.model_section.is_moe:
            return None
        from megatron_mvmoe.routing.trace import start_router_trace

        return start_router_trace(self.trainer.model, lg.moe_routing_trace_path,
                                  lg.moe_routing_trace_max_iters, dist.get_rank(),
                                  capture_logits=lg.moe_routing_trace_capture_logits)

    def iterators(self):
        return [self.data.train_iterator(self.state.consumed_samples)
                for _ in self.trainer.model]

    def one_step(self, iterators) -> Dict[str, float]:
        step = self.state.step + 1
        if self.on_step is not None:
            self.on_step(step, self.trainer)
        # Megatron's calculator: this step's batch from the samples consumed so far (a
        # resume recomputes it from the checkpoint's count, so the ramp continues exactly).
        self.batches.update(self.state.consumed_samples, consistency_check=True)
        num_microbatches = self.batches.get()
        global_batch = self.batches.get_current_global_batch_size()
        metrics = train_step(self.trainer, iterators, num_microbatches,
                             self.stops.local_flags().as_list())
        if self.tracer is not None:
            self.tracer.advance_step(step)
        if metrics["nonfinite"]:
            self._on_nonfinite(step, metrics)
        if metrics.get("loss_scale_overflow"):  # fp16: Megatron-LM counts it skipped too
            self.state.skipped_iters += 1
        self.watch.reset()
        gamma = self.advance_gamma()
        self.state.step = step
        self.state.consumed_samples += global_batch
        self.window["samples"] += global_batch
        self.window["microbatches"] += num_microbatches
        self.state.gamma = gamma
        metrics["gamma"] = gamma
        metrics["global_batch_size"] = global_batch
        metrics["skipped_iters"] = self.state.skipped_iters
        self.result.stopped = self.stops.reason(step, StopFlags(*metrics.pop("stop")))
        return metrics

    def _on_nonfinite(self, step: int, metrics: Dict) -> None:
        """The update was not applied (step.py): skip it (counted, logged) or stop."""
        t = self.run.training
        if not t.skip_nonfinite:
            raise nonfinite_error(metrics["loss"], metrics["grad_norm"], step,
                                  self.watch if t.exit_on_nonfinite else None,
                                  self.result.last_checkpoint)
        self.state.skipped_iters += 1
        self.log.line(f"step {step}: loss {metrics['loss']}, grad norm {metrics['grad_norm']}: "
                      f"update skipped (--skip-nonfinite); number of skipped iterations: "
                      f"{self.state.skipped_iters}")

    def report(self, metrics: Dict, seconds: float, steps: int) -> None:
        t, model = self.run.training, self.trainer.model_section
        tokens = self.window["samples"] * model.seq_length
        microbatches = self.window["microbatches"]
        self.window = {"samples": 0, "microbatches": 0}
        metrics = dict(metrics, tokens_per_s=tokens / max(seconds, 1e-9),
                       consumed_samples=self.state.consumed_samples)
        metrics.update(self.efficiency.figures(metrics["tokens_per_s"], seconds / max(steps, 1),
                                               self.state.step))
        if self.routing is not None:
            metrics["routing"] = routing_summary(self.routing.reduce(),
                                                 aux_losses(microbatches, self.trainer.config,
                                                            self.trainer.pg_collection),
                                                 self.routing.reduce_diversity())
        metrics.update(mtp_losses(microbatches, self.trainer.config, self.trainer.pg_collection))
        if self.a2a is not None:
            metrics["a2a"] = self.a2a.reduce(steps)
        self.log.record("train", self.state.step, metrics)
        gamma = "" if metrics.get("gamma") is None else f" | gamma {metrics['gamma']:.3f}"
        skipped = (f" | skipped iterations {self.state.skipped_iters}"
                   if self.state.skipped_iters else "")
        batch = (f" | global batch {metrics['global_batch_size']}"  # the ramp's current one
                 if t.rampup_batch_size is not None else "")
        mtp = "".join(f" | {k} {v:.4f}" for k, v in metrics.items() if k.startswith("mtp_")
                      and k.endswith("_loss"))
        self.log.line(f"step {self.state.step:6d}/{t.train_iters} | loss {metrics['loss']:.4f} "
                      f"| lr {metrics['lr']:.3e} | grad norm {metrics['grad_norm']:.3f} | "
                      f"{metrics['tokens_per_s']:.0f} tok/s{gamma}{skipped}{batch}{mtp}"
                      f"{self.efficiency.text(metrics)}")
        if self.a2a is not None:
            self.log.line(a2a_summary_line(metrics["a2a"]))

    def evaluate(self) -> Dict[str, float]:
        # eval_iters global batches: the same samples whatever the layout.
        losses = evaluate(self.trainer, self.data,
                          self.run.training.eval_iters * self.num_microbatches,
                          self.trainer.pg_collection)
        values = {d: {"loss": v, "ppl": _ppl(v)} for d, v in losses.items()}
        self.log.record("eval", self.state.step, values)
        self.log.line(f"eval step {self.state.step}: " + ", ".join(
            f"{d} loss {v:.4f} ppl {_ppl(v):.1f}" for d, v in losses.items()))
        return losses

    def save(self, wait: bool = False) -> None:
        """Save now (sync), or start a background save (--async-save; `wait` blocks until
        it is published, as the last save of a run must)."""
        if self.run.training.save is None:
            return
        if self.saver is None:
            path = ckpt.save_checkpoint(self.trainer, self.run.training.save, self.state)
            self.published(path)
            return
        self.published(self.saver.wait())  # one background save in flight at a time
        path = self.saver.save(self.trainer, self.run.training.save, self.state)
        self.log.line(f"started background save of {path}")
        if wait:
            self.published(self.saver.wait())

    def poll_saves(self) -> None:
        if self.saver is not None:
            self.published(self.saver.poll())

    def published(self, path: Optional[str]) -> None:
        if path is not None:
            self.result.last_checkpoint = path
            self.log.line(f"saved checkpoint {path}")

    def stop_early(self) -> None:
        """A signal, the time budget or the exit interval: save this step and stop, leaving
        the marker the sbatch recipes requeue on."""
        self.log.line(f"stopping after step {self.state.step}: {self.result.stopped}")
        save = self.run.training.save
        if save is None:
            self.log.line("warning: no --save, so nothing was saved before stopping")
            return
        self.save(wait=True)
        if dist.get_rank() == 0:
            write_json_atomic(os.path.join(save, STOPPED_MARKER), marker_payload(
                self.state.step, self.result.stopped, self.result.last_checkpoint))

    def close(self) -> None:
        if self.tracer is not None:
            self.tracer.flush()
        self.stops.restore()
        if self.saver is not None:
            self.saver.close()
        close_writer_processes()
        self.watch.close()
        for monitor in (self.routing, self.a2a):
            if monitor is not None:
                monitor.close()
        self.log.close()


def _ppl(loss: float) -> float:
    import math

    return math.exp(min(loss, 50.0))


def _same_dir(a: Optional[str], b: Optional[str]) -> bool:
    return a is not None and b is not None and os.path.realpath(a) == os.path.realpath(b)


def _due(step: int, interval: int) -> bool:
    return interval > 0 and step % interval == 0


def pretrain(run: RunConfig, pg_collection,
             on_step: Optional[Callable[[int, Trainer], None]] = None,
             start: Optional[Start] = None) -> RunResult:
    """Train `run` on the initialised layout; returns losses and final evaluation.
    `start`: the launcher's `start_up(run, world)` (tokenizer, vocabulary and validated
    Megatron config, built once per launch); None = built here (direct callers, tests).
    `run` is not changed either way."""
    if start is None:  # a direct call; a launch passes the Start it built
        start = start_up(run, dist.get_world_size())
    run = start.run  # the tokenizer's vocabulary (training/startup.py)
    if run.training.warm_start_from is not None:  # before any weight is built
        check_target(run.model, run.training.moe_use_upcycling)
    on_step = memory_hook(run, on_step, pg_collection)  # fit check; memory/rank<R>.json
    # One writer per --save (refused with the holder's name), and this rank's record for
    # the job-end summary (rank_reports.py), written only while the lock is held.
    with hold_save_lock(run.training.save), recording(run.training.save, dist.get_rank(),
                                                      dist.get_world_size()):
        return _train(start, pg_collection, on_step)


def _train(start: Start, pg_collection, on_step) -> RunResult:
    loop = _Loop(start, pg_collection, on_step)
    run, t = start.run, start.run.training
    loop.stops.install()
    try:
        loop.resume()
        if dist.get_rank() == 0:  # banner; versions.json, config.yaml in the run dir
            write_run_files(run.logging.run_dir, run, loop.trainer.model_section, loop.efficiency,
                            dist.get_world_size(), loop.log.line)
        loop.result.first_step = loop.state.step + 1
        first_samples = loop.state.consumed_samples
        iterators = loop.iterators()
        window_start, window_steps = time.perf_counter(), 0
        total_start, total_steps = window_start, 0
        while loop.state.step < t.train_iters:
            metrics = loop.one_step(iterators)
            loop.poll_saves()
            loop.result.losses.append(metrics["loss"])
            window_steps += 1
            total_steps += 1
            step = loop.state.step
            if _due(step, run.logging.log_interval) or step == t.train_iters:
                loop.report(metrics, time.perf_counter() - window_start, window_steps)
                window_start, window_steps = time.perf_counter(), 0
            if _due(step, t.check_weight_hash_interval or 0):
                check_weight_hashes(loop.trainer.model, step, loop.log.line)
            if _due(step, t.eval_interval) and step < t.train_iters:
                loop.evaluate()
            if loop.result.stopped and step < t.train_iters:
                loop.stop_early()
                break
            if _due(step, t.save_interval) and step < t.train_iters:
                loop.save()
        loop.result.skipped_iters = loop.state.skipped_iters
        if loop.result.stopped and loop.state.step < t.train_iters:
            return loop.result
        loop.result.stopped = None  # a stop request at the last step changes nothing
        elapsed = time.perf_counter() - total_start
        loop.result.tokens_per_second = ((loop.state.consumed_samples - first_samples) *
                                         loop.trainer.model_section.seq_length / max(elapsed, 1e-9))
        if t.eval_iters > 0:
            loop.result.eval = loop.evaluate()
        if not loop.already_saved(total_steps):
            loop.save(wait=True)
        return loop.result
    finally:
        loop.close()


if __name__ == "__main__":
    sys.exit(main())
