"""The project against torchtitan 0.3.0 at equal work, and Multi-View against its latent
baseline (issue 42 item 4). A benchmark, not a test (not in CI):

    OMP_NUM_THREADS=1 python tools/bench_peer.py                      # both shapes, 3 rounds
    OMP_NUM_THREADS=1 python tools/bench_peer.py --shapes issue --rounds 5 --json

Installs torchtitan 0.3.0 on first use into --titan-dir (default .peer/, git-ignored; pip
--no-deps plus the few pure-Python packages its model imports, never another torch). At
each shape (training/step_bench.py: "issue" = 4 layers, D 256, 4 heads with QK-norm, 8
SwiGLU experts of width 512, top-2, vocab 4096, seq 256; "wide" = D 512, 8 heads, 16
experts, top-4, seq 512; 1024 tokens a step, fp32, dropout off, one thread) it builds the
project's smoe GPTModel (the trainer's build path) and torchtitan's Qwen3-MoE, asserts
equal parameter counts (total and active) and forward FLOPs per token, and times the same
bare loop on the same batch (forward, token-mean cross-entropy, backward, clip 1.0, torch
AdamW foreach) in rounds, the order rotated each round, on this process's CPU time (the
machine may be shared). It prints per-round ratios project tokens/s / torchtitan tokens/s,
their median and spread, against torchtitan eager (its default, `compile.enable` false) and
against torchtitan with its own per-block torch.compile (inductor; --no-titan-compile skips
it): the project side runs what the trainer builds (its fast-path defaults, the banner's
fusions line). Then Multi-View / latent baseline step time at the same shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as py_platform
import subprocess
import sys
from typing import Dict, List

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", choices=["issue", "wide"], default=["issue", "wide"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="steps per model per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--titan-dir", default=os.path.join(REPO, ".peer", "torchtitan-0.3.0"))
    p.add_argument("--no-titan-compile", action="store_true",
                   help="skip the row against torchtitan's per-block torch.compile")
    p.add_argument("--no-multi-view", action="store_true",
                   help="skip Multi-View against its latent baseline")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(l.split(":", 1)[1].strip() for l in out.splitlines()
                    if l.startswith("Model name"))
    except (OSError, StopIteration):
        return py_platform.processor() or "unknown"


def _counts(model, fields) -> Dict[str, int]:
    from megatron_mvmoe.analysis import peer_titan

    k, e = fields["moe_router_topk"], fields["num_experts"]
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    return {"params": total, "active_params": total - experts + experts * k // e,
            "fwd_flops_per_token": peer_titan.matmul_flops_per_token(
                model, k, e, fields["seq_length"], fields["num_layers"],
                fields["hidden_size"])}


def peer_shape(shape: str, args, pgs_for) -> Dict:
    from megatron_mvmoe.analysis import peer_titan
    from megatron_mvmoe.training import step_bench as sb

    run = sb.run_config(sb.raw_run(shape, "smoe"))
    project = sb.BareStep(run, pgs_for(run))
    titans = {"torchtitan": peer_titan.TitanStep(peer_titan.build_model(sb.SHAPES[shape]))}
    if not args.no_titan_compile:
        titans["torchtitan compiled"] = peer_titan.TitanStep(
            peer_titan.compile_blocks(peer_titan.build_model(sb.SHAPES[shape])))
    counts = {"project": _counts(project.model, sb.SHAPES[shape]),
              "torchtitan": _counts(titans["torchtitan"].model, sb.SHAPES[shape])}
    assert counts["project"] == counts["torchtitan"], f"unequal work at {shape}: {counts}"
    batch = sb.one_batch(run)
    steps = {"project": lambda: project(batch),
             **{name: (lambda t=t: t(batch)) for name, t in titans.items()}}
    times = sb.interleaved(steps, args.rounds, args.steps, warmup=args.warmup,
                           clock=sb.CLOCKS["cpu"])
    # tokens/s ratio project / torchtitan = time ratio torchtitan / project
    return {"shape": shape, "fields": sb.SHAPES[shape], "counts": counts,
            "project_fast_paths": _project_fusions(run),
            "seconds_per_step": times,
            **{f"project_over_{name.replace(' ', '_')}_tokens_per_s":
               sb.ratio_summary(times[name], times["project"]) for name in titans}}


def _project_fusions(run) -> str:
    """The banner's fusions line of the project's run (what the trainer builds)."""
    from megatron_mvmoe.models.fast_paths import fusions_line
    from megatron_mvmoe.training.build import run_fast_paths

    return fusions_line(run_fast_paths(run))


def multi_view_shape(shape: str, args, pgs_for) -> Dict:
    from megatron_mvmoe.training import step_bench as sb

    steps = {}
    for variant in ("latent", "multi_view"):
        run = sb.run_config(sb.raw_run(shape, variant))
        steps[variant] = (sb.BareStep(run, pgs_for(run)), sb.one_batch(run))
    times = sb.interleaved({v: (lambda s=s, b=b: s(b)) for v, (s, b) in steps.items()},
                           args.rounds, args.steps, warmup=args.warmup, clock=sb.CLOCKS["cpu"])
    return {"shape": shape, "latent_size": sb.SHAPES[shape]["hidden_size"] // sb.LATENT_DIVISOR,
            "seconds_per_step": times,
            "multi_view_over_latent_time": sb.ratio_summary(times["multi_view"], times["latent"])}


def measure(rank: int, world: int, args) -> Dict:
    from megatron_mvmoe.analysis import peer_titan
    from megatron_mvmoe.training import step_bench as sb

    torch.set_num_threads(1)
    peer_titan.ensure_installed(args.titan_dir)
    layouts = {}

    def pgs_for(run):
        if not layouts:
            layouts["pgs"] = sb.rank_setup(run)[1]
        return layouts["pgs"]
    out = {"cpu": cpu_model(), "torch": torch.__version__, "threads": 1, "clock": "cpu",
           "rounds": args.rounds, "steps_per_round": args.steps,
           "note": peer_titan.CPU_NOTE + ("" if args.no_titan_compile
                                          else "; " + peer_titan.COMPILED_NOTE),
           "load_average": os.getloadavg(), "peer": [], "multi_view": []}
    for shape in args.shapes:
        out["peer"].append(peer_shape(shape, args, pgs_for))
        if not args.no_multi_view:
            out["multi_view"].append(multi_view_shape(shape, args, pgs_for))
    out["load_average_after"] = os.getloadavg()
    return out


def _rank_entry(rank, world, args):
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):
        return measure(rank, world, args)


def _ratios(r: Dict) -> str:
    return (" ".join(f"{x:.3f}" for x in r["per_round"]) +
            f"  median {r['median']:.3f} [{r['min']:.3f}, {r['max']:.3f}]")


def report(out: Dict) -> str:
    lines = [f"CPU: {out['cpu']}; torch {out['torch']}; 1 thread; fp32; CPU-time clock; "
             f"{out['rounds']} rounds x {out['steps_per_round']} steps, order rotated; load "
             f"average {out['load_average'][0]:.1f} before, {out['load_average_after'][0]:.1f} "
             "after", out["note"]]
    for p in out["peer"]:
        c = p["counts"]["project"]
        t = p["seconds_per_step"]
        lines.append(f"[{p['shape']}] {c['params']:,} params ({c['active_params']:,} active), "
                     f"{c['fwd_flops_per_token']:,} fwd FLOPs/token, equal on both sides")
        lines.append(f"  project {p['project_fast_paths']}")
        lines.append("  s/step " + "; ".join(f"{name} {' '.join(f'{x:.3f}' for x in ts)}"
                                             for name, ts in t.items()))
        for name in t:
            if name != "project":
                lines.append(f"  project / {name} tokens/s per round: " + _ratios(
                    p[f"project_over_{name.replace(' ', '_')}_tokens_per_s"]))
    for m in out["multi_view"]:
        lines.append(f"[{m['shape']}] Multi-View / latent baseline (L = {m['latent_size']}) "
                     "step time per round: " + _ratios(m["multi_view_over_latent_time"]))
    return "\n".join(lines)


def main(argv: List[str] = None) -> int:
    from megatron_mvmoe.launch.local_ranks import run_distributed

    args = parse_args(sys.argv[1:] if argv is None else argv)
    out = run_distributed(_rank_entry, 1, timeout_s=7200, args=(args,), daemon=False)[0]
    print(json.dumps(out, indent=1) if args.json else report(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
