"""Plan a model on a layout: parameters (total/active), parameter overhead of every variant
of its family against the baseline (with the paper's figures), FLOPs per token, per-GPU
memory, all-to-all bytes per step, the context-parallel term (--cp: tokens per rank, the
CP attention's K/V all-gather bytes, attention FLOPs per rank;
planning/context_parallel.py); --dry-run builds rank 0 on the meta device.

The world size is --world-size, else the YAML's parallel.world_size, else the "<N>gpu" in
the YAML's file name, else the smallest world the layout needs. A layout the trainer would
refuse (tp*pp or ep*etp*pp not dividing the world, layers not divisible by pp, experts not
divisible by ep, batch not divisible) is refused here too, with exit code 2.

  python tools/plan.py --config examples/configs/mvmoe_10b_a1b_64gpu.yaml --json
  python tools/plan.py --config mvmoe_10b_a1b --tp 1 --pp 1 --ep 8 --world-size 8
  python tools/plan.py --config mvmoe_10b_a1b --tp 2 --ep 8 --cp 2 --world-size 16
  python tools/plan.py --config examples/tiny_cpu.yaml --dry-run
  python tools/plan.py --config examples/configs/mvmoe_10b_a1b_64gpu.yaml --fast-paths --json
  python tools/plan.py --config mvmoe_10b_a1b --fast-paths --target cpu --probe-inductor
  python tools/plan.py --config examples/configs/mvmoe_10b_a1b_slice_cpu.yaml --precision cpu_fp32
  python tools/plan.py --validate runs/slices/mv_ep2 --json   # planner vs a run's memory

Memory by category per rank and pipeline stage (planning/memory.py): parameters,
gradient (main-grad) buffers, optimizer states sharded like the distributed optimizer,
activations per microbatch x microbatches in flight (MoE dispatch buffers and views
included), the checkpoint save's transient; for the GPU bf16 + fp32-master run and the CPU
fp32 run. --validate sets it against what a run recorded in <run_dir>/memory/.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from megatron_mvmoe.analysis.overheads import overhead_lines, parameter_overheads
from megatron_mvmoe.planning.plan import (PlanTarget, check_layout, dry_run_build, plan,
                                          planned_world_size)
from megatron_mvmoe.planning.memory import PRECISIONS, memory_by_stage
from megatron_mvmoe.planning.validate import table_lines, validate
from megatron_mvmoe.config.model_section import model_from_preset
from megatron_mvmoe.config.presets import PRESETS, preset_names
from megatron_mvmoe.config.run_config import load_yaml
from megatron_mvmoe import platform
from megatron_mvmoe.models import fast_paths
from megatron_mvmoe.parallel import ParallelLayout


def _model(name: str, num_layers=None):
    if name in PRESETS:
        model, run = model_from_preset(name), None
    elif os.path.isfile(name):
        run = load_yaml(name)
        model = run.model
    else:
        model = None
    if model is not None:
        if num_layers is not None:
            model = dataclasses.replace(model, num_layers=num_layers)
            if run is not None:
                run = dataclasses.replace(run, model=model)
        return model, run
    raise ValueError(f"--config: {name!r} is neither a preset ({preset_names()}) nor a YAML "
                     "file. Fix: pass one of those")


def _target(args, run) -> PlanTarget:
    par = run.parallel if run is not None else None
    world = planned_world_size(args.config if run is not None else None,
                               par.world_size if par else None, args.world_size)
    pick = lambda flag, field, default: (flag if flag is not None else
                                          (getattr(par, field) if par else default))
    train = run.training if run is not None else None
    layout = ParallelLayout(tp=pick(args.tp, "tp", 1), pp=pick(args.pp, "pp", 1),
                            ep=pick(args.ep, "ep", 1), etp=pick(args.etp, "etp", 1),
                            cp=pick(args.cp, "cp", 1))
    return PlanTarget(
        layout, world_size=world,
        micro_batch_size=args.micro_batch_size or (train.micro_batch_size if train else 1),
        global_batch_size=args.global_batch_size or (
            train.global_batch_size if train else 256))


PLAN_NOT_PROBED = ("inductor's C++ compile not probed (tools/plan.py compiles only with "
                   "--probe-inductor; the trainer probes once at start-up and fuses where "
                   "it compiles)")
"""The CPU's SwiGLU reason without --probe-inductor, for a model big enough to fuse."""


def _fast_path_target(name: str, probe_inductor: bool) -> fast_paths.Target:
    """gpu: a CUDA node with TE; cpu, and here without a GPU: a CPU as the trainer builds
    for it, whose inductor probe (a compile) runs only with --probe-inductor."""
    if name == "gpu":
        return fast_paths.Target(cuda=True, te=True)
    if name == "here" and platform.is_cuda():
        return fast_paths.Target.here()
    if probe_inductor:
        return fast_paths.Target.cpu(probe_inductor=True)
    return fast_paths.Target(cuda=False, te=False, inductor_blocker=PLAN_NOT_PROBED)


def fast_path_report(model, run, targets, etp: int = 1, probe_inductor: bool = False) -> dict:
    """{target: {fast path: {on, why}}} for the model (its variant and sizes) and the run's
    optimizer settings: what models/provider.py would build there (model_fast_paths)."""
    from megatron_mvmoe.models.provider import model_fast_paths

    optimizer = run.optimizer if run is not None else None
    return {name: fast_paths.as_dict(model_fast_paths(
        model, _fast_path_target(name, probe_inductor), etp, optimizer)) for name in targets}


def _human_fast_paths(report) -> list:
    lines = []
    for target, paths in report.items():
        label = {"gpu": "GPU with TransformerEngine", "cpu": "CPU (gloo)",
                 "here": "this machine"}[target]
        lines.append(f"fast paths on {label}:")
        lines += [f"  [{'on ' if p['on'] else 'off'}] {name}: {p['why']}"
                  for name, p in paths.items()]
    return lines


def _human_context_parallel(cp) -> list:
    if cp["cp"] == 1:
        return []
    return [f"context parallel: cp={cp['cp']}, {cp['tokens_per_rank_per_microbatch']} tokens "
            f"per rank per microbatch; K/V all-gather "
            f"{cp['kv_all_gather_bytes_per_layer'] / 2**20:.1f} MiB per layer (backward "
            f"all-reduce {cp['kv_grad_all_reduce_bytes_per_layer'] / 2**20:.1f} MiB), "
            f"{cp['kv_bytes_per_rank_per_step'] / 2**30:.2f} GiB per rank per step; "
            f"attention {cp['attention_train_flops_per_rank_per_step'] / 1e12:.2f} TFLOP "
            f"per rank per step"]


def _human(report) -> str:
    p, f = report["parameters"], report["flops_per_token"]
    mem, a2a, lay = report["memory_bytes_per_gpu"], report["a2a_bytes"], report["layout"]
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    lines = [f"layout: tp={lay['tp']} pp={lay['pp']} cp={lay['cp']} ep={lay['ep']} "
             f"etp={lay['etp']} "
             f"world={lay['world_size']} dp={lay['dp']}",
             f"parameters: total {p['total'] / 1e9:.3f} B, active {p['active'] / 1e9:.3f} B "
             f"(without embeddings {p['active_without_embeddings'] / 1e9:.3f} B)",
             f"FLOPs/token: forward {f['forward'] / 1e9:.2f} G, train {f['train'] / 1e9:.2f} G",
             "memory/GPU: " + ", ".join(f"{k} {gib(v)}" for k, v in mem.items()),
             f"all-to-all: {a2a['per_layer_dispatch'] / 2**20:.1f} MiB per layer dispatch, "
             f"{a2a['per_rank_per_step'] / 2**30:.2f} GiB per rank per step",
             *_human_context_parallel(report["context_parallel"]),
             *overhead_lines(report["parameter_overheads"])]
    for precision, stages in report.get("memory_by_rank", {}).items():
        lines.append(f"memory per rank by category ({precision}; runtime not included):")
        for row in stages:
            lines.append(f"  stage {row['stage']}: " + ", ".join(
                f"{k} {gib(row[k])}" for k in ("params", "grads", "optimizer", "activations",
                                              "collective_transient",
                                              "optimizer_step_transient",
                                              "checkpoint_save_transient", "total_with_save"))
                + f" (activations {gib(row['activations_per_microbatch'])} per microbatch x "
                  f"{row['microbatches_in_flight']:.0f} in flight)")
    if "fast_paths" in report:
        lines += _human_fast_paths(report["fast_paths"])
    if "dry_run" in report:
        lines.append(f"dry run: rank 0 built with {report['dry_run']['rank0_parameters']:,} "
                     "parameters on the meta device")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="preset name or run YAML (required without "
                                           "--validate)")
    for flag, what in (("--tp", "tensor-parallel size"), ("--pp", "pipeline stages"),
                       ("--ep", "expert-parallel size"), ("--etp", "expert tensor-parallel"),
                       ("--cp", "context-parallel size (sequence split over CP ranks)"),
                       ("--world-size", "GPUs (default: see above)"),
                       ("--micro-batch-size", "sequences per microbatch"),
                       ("--global-batch-size", "sequences per step")):
        parser.add_argument(flag, type=int, default=None,
                            help=f"{what}; default: the YAML's, else 1 (global batch 256)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="plan the config with this many layers (e.g. a larger slice)")
    parser.add_argument("--precision", choices=(*PRECISIONS, "both"), default="both",
                        help="memory by category for cpu_fp32, gpu_bf16 (+ fp32 master) or both")
    parser.add_argument("--validate", metavar="RUN_DIR", default=None,
                        help="print the planner's memory per rank and category against what "
                             "the run in RUN_DIR measured (its memory/rank<R>.json)")
    parser.add_argument("--dry-run", action="store_true",
                        help="build rank 0 on the meta device to validate shapes")
    parser.add_argument("--fast-paths", action="store_true",
                        help="list which fast path (TE specs, grouped GEMM, fusions, flash "
                             "attention, overlapped DDP, bf16) is on for the variant, and why "
                             "any is off")
    parser.add_argument("--target", choices=("gpu", "cpu", "here", "both"), default="both",
                        help="machine for --fast-paths: gpu (CUDA + TransformerEngine), cpu, "
                             "here (this machine), or both gpu and cpu (default)")
    parser.add_argument("--probe-inductor", action="store_true",
                        help="with --fast-paths: on a CPU target, compile one tiny function "
                             "with torch.compile (seconds, once: platform/inductor_probe.py, "
                             "the trainer's start-up probe) to learn whether the fused SwiGLU "
                             "runs on this machine; only asked where the model's SwiGLU call "
                             "is big enough to fuse. Without it that line says 'not probed'")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        if args.validate is not None:
            checked = validate(args.validate)
            print(json.dumps(checked, indent=1) if args.json else "\n".join(table_lines(checked)))
            return 0
        if args.config is None:
            raise ValueError("--config: required (a preset name or a run YAML). Fix: pass "
                             "--config, or --validate RUN_DIR")
        model, run = _model(args.config, args.num_layers)
        target = _target(args, run)
        check_layout(model, target)
        report = plan(model, target)
        dist_opt = run.optimizer.use_distributed_optimizer if run is not None else True
        precisions = PRECISIONS if args.precision == "both" else (args.precision,)
        report["memory_by_rank"] = {p: memory_by_stage(model, target, p, dist_opt)
                                    for p in precisions}
        report["parameter_overheads"] = parameter_overheads(model)
        if args.dry_run:
            report["dry_run"] = dry_run_build(model, target)
        if args.fast_paths:
            targets = ("gpu", "cpu") if args.target == "both" else (args.target,)
            report["fast_paths"] = fast_path_report(model, run, targets, target.layout.etp,
                                                    args.probe_inductor)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1, default=str) if args.json else _human(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
