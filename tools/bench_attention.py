"""Side-by-side timing of the core attention: torch SDPA (layers/sdpa_attention.py) against
Megatron's local DotProductAttention ("unfused"), forward + backward, issue 42 item 1.

    python tools/bench_attention.py                        # issue 42's shape, CPU clock
    python tools/bench_attention.py --seq 1024 --groups 2 --json
    python tools/bench_attention.py --dtype bf16 --clock wall   # on a GPU

Default shape: issue 42's (4 heads of 64 = hidden 256, sequence 256, micro batch 4),
fp32. Both modules are built from the same Megatron config on a one-rank group and run on
the same q/k/v; every round times each once, the order rotating per round, and the ratio
sdpa / unfused is taken per round (median, min, max), so a machine shared with other jobs
moves both sides of a pair alike. --clock cpu (the default) times the process's CPU time,
which with --threads 1 is the work, not the scheduler's share of a loaded machine.
It also names the aten SDPA kernel that ran (profiler: flash, memory-efficient, cuDNN or
the math fallback) and, on CUDA, torch.backends.cuda's kernel switches; tools/gpu_check.sh
runs it as its `attention` stage. Not a test: the figures go to
examples/results/sdpa_attention.md by hand, with the load at the time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from typing import Dict, List

import torch

warnings.filterwarnings("ignore")

from megatron_mvmoe.analysis import layer_bench as lb  # noqa: E402


def parse_args(argv: List[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--groups", type=int, default=None, help="query groups (default: heads)")
    p.add_argument("--head-dim", type=int, default=64, help="head width (kv_channels)")
    p.add_argument("--seq", type=int, default=256, help="sequence length")
    p.add_argument("--batch", type=int, default=4, help="micro batch")
    p.add_argument("--dropout", type=float, default=0.0, help="attention dropout")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--rounds", type=int, default=12, help="timed rounds (pairs)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--clock", choices=sorted(lb.CLOCKS), default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    p.add_argument("--model-step", action="store_true",
                   help="also time whole-model forward + backward pairs: issue 42's smoe "
                        "(4 layers, QK norm, 8 experts of 512, top-2, vocabulary 4096) "
                        "built with each backend, the same weights")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p.parse_args(argv)


def build_pair(args, pgs) -> Dict[str, torch.nn.Module]:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_mvmoe.layers.sdpa_attention import SDPADotProductAttention

    config = TransformerConfig(
        num_layers=1, hidden_size=args.heads * args.head_dim, num_attention_heads=args.heads,
        num_query_groups=args.groups or args.heads, kv_channels=args.head_dim,
        attention_dropout=args.dropout, masked_softmax_fusion=torch.cuda.is_available(),
        bf16=args.dtype == "bf16")
    return {name: cls(config, 1, AttnMaskType.causal, "self", pg_collection=pgs).train()
            for name, cls in (("unfused", DotProductAttention),
                              ("sdpa", SDPADotProductAttention))}


def inputs(args) -> List[torch.Tensor]:
    from megatron_mvmoe import platform

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(0)
    groups = args.groups or args.heads
    shapes = ((args.seq, args.batch, args.heads, args.head_dim),
              (args.seq, args.batch, groups, args.head_dim),
              (args.seq, args.batch, groups, args.head_dim))
    return [torch.randn(s, generator=gen).to(platform.device(), dtype).requires_grad_(True)
            for s in shapes]


def forward_backward(core, qkv: List[torch.Tensor]) -> None:
    out = core(*qkv, None)
    out.backward(torch.ones_like(out))
    for t in qkv:
        t.grad = None


def timed_pairs(cores: Dict[str, torch.nn.Module], qkv, args) -> Dict[str, List[float]]:
    """{name: [seconds per round]}, both once per round, the order rotating."""
    from megatron_mvmoe import platform

    now = lb.CLOCKS[args.clock]
    names = list(cores)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for round_index in range(args.warmup + args.rounds):
        order = names[round_index % 2:] + names[:round_index % 2]
        for name in order:
            platform.synchronize()
            start = now()
            forward_backward(cores[name], qkv)
            platform.synchronize()
            if round_index >= args.warmup:
                times[name].append(now() - start)
    return times


ISSUE_42_MODEL = dict(moe_variant="smoe", num_layers=4, num_experts=8, moe_ffn_hidden_size=512,
                      moe_router_topk=2, ffn_hidden_size=1024, vocab_size=4096,
                      extra=dict(qk_layernorm=True))
"""Issue 42's baseline model; heads, head width and sequence come from the flags."""


def build_models(args, pgs) -> Dict[str, torch.nn.Module]:
    """The same smoe model (same seed, so the same weights) with each core attention."""
    from megatron_mvmoe.config.model_section import model_from_preset
    from megatron_mvmoe.models.provider import build_model_chunks, transformer_config
    from megatron_mvmoe.platform import seed_all

    models = {}
    for name, backend in (("unfused", "unfused"), ("sdpa", "sdpa")):
        section = model_from_preset(
            "tiny_smoe", **ISSUE_42_MODEL, hidden_size=args.heads * args.head_dim,
            num_attention_heads=args.heads, num_query_groups=args.groups,
            seq_length=args.seq, attention_backend=backend)
        config = transformer_config(section, on_cpu=not torch.cuda.is_available(),
                                    use_bf16=args.dtype == "bf16")
        assert config.sdpa_attention is (backend == "sdpa")
        seed_all(0)
        models[name] = build_model_chunks(config, section, pgs)[0].train()
    return models


def model_step(model, tokens_BS1: torch.Tensor) -> None:
    tokens, labels = tokens_BS1[:, :-1], tokens_BS1[:, 1:]
    positions = torch.arange(tokens.size(1), device=tokens.device)[None].expand_as(tokens)
    model(tokens, positions, None, labels=labels).mean().backward()
    model.zero_grad(set_to_none=True)


def timed_model_pairs(models, args) -> Dict[str, List[float]]:
    from megatron_mvmoe import platform

    tokens = torch.randint(0, ISSUE_42_MODEL["vocab_size"], (args.batch, args.seq + 1),
                           generator=torch.Generator().manual_seed(1)).to(platform.device())
    now, names = lb.CLOCKS[args.clock], list(models)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for round_index in range(args.warmup + args.rounds):
        for name in names[round_index % 2:] + names[:round_index % 2]:
            platform.synchronize()
            start = now()
            model_step(models[name], tokens)
            platform.synchronize()
            if round_index >= args.warmup:
                times[name].append(now() - start)
    return times


def sdpa_kernels_ran(core, qkv) -> List[str]:
    """The aten SDPA kernels one forward + backward of `core` ran (profiler op names:
    _scaled_dot_product_flash_attention[_for_cpu], _efficient_, _cudnn_, or the math
    fallback _scaled_dot_product_attention_math)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        forward_backward(core, qkv)
    names = {e.key for e in prof.key_averages()}
    return sorted(n for n in names if n.startswith("aten::_scaled_dot_product")
                  and not n.endswith("_backward"))


def sdpa_switches() -> Dict[str, bool]:
    """torch.backends.cuda's SDPA kernel switches (CUDA only; empty on CPU)."""
    if not torch.cuda.is_available():
        return {}
    cuda = torch.backends.cuda
    return {"flash": cuda.flash_sdp_enabled(), "mem_efficient": cuda.mem_efficient_sdp_enabled(),
            "cudnn": cuda.cudnn_sdp_enabled(), "math": cuda.math_sdp_enabled()}


def causal_flops(args) -> float:
    """Forward + backward model FLOPs of causal attention: QK^T and PV, 2 x b x n x s^2 x d
    each, half of it under the causal mask, backward twice the forward."""
    return 3 * 0.5 * 4 * args.batch * args.heads * args.seq ** 2 * args.head_dim


def report(args, times: Dict[str, List[float]], kernels: List[str]) -> Dict:
    from megatron_mvmoe.layers.sdpa_attention import torch_version

    flops = causal_flops(args)
    return {"sdpa_kernels": kernels, "sdpa_switches": sdpa_switches(),
            "tflops": {name: flops / lb.spread(t)["median"] / 1e12
                       for name, t in times.items()},
            "shape": {k: getattr(args, k) for k in ("heads", "groups", "head_dim", "seq",
                                                    "batch", "dropout", "dtype")},
            "torch": torch_version(), "clock": args.clock, "threads": torch.get_num_threads(),
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "seconds": {name: lb.spread(t) for name, t in times.items()},
            "sdpa_over_unfused": lb.pair_ratios(times["sdpa"], times["unfused"]),
            "rounds": args.rounds}


def text(out: Dict) -> str:
    ratio, shape = out["sdpa_over_unfused"], out["shape"]
    lines = [f"sdpa kernel: {', '.join(out['sdpa_kernels'])}"
             + (f" (torch.backends.cuda switches {out['sdpa_switches']})"
                if out["sdpa_switches"] else ""),
             f"core attention fwd+bwd, {shape['heads']} heads x {shape['head_dim']}, seq "
             f"{shape['seq']}, batch {shape['batch']}, {shape['dtype']}, dropout "
             f"{shape['dropout']}; torch {out['torch']}, {out['clock']} clock, "
             f"{out['threads']} thread(s), 1-min load average "
             f"{out['load_average_1min']:.1f}"]
    for name, s in out["seconds"].items():
        lines.append(f"{name:8s} median {1e3 * s['median']:8.2f} ms  [min "
                     f"{1e3 * s['min']:.2f}, max {1e3 * s['max']:.2f}]  "
                     f"{out['tflops'][name]:.4f} TFLOP/s")
    lines.append(f"sdpa / unfused per pair: median {ratio['median']:.3f} [min "
                 f"{ratio['min']:.3f}, max {ratio['max']:.3f}] over {out['rounds']} pairs")
    step = out.get("model_step")
    if step:
        r, s = step["sdpa_over_unfused"], step["seconds"]
        lines.append(f"whole smoe model fwd+bwd (issue 42's shape): unfused "
                     f"{s['unfused']['median']:.3f} s, sdpa {s['sdpa']['median']:.3f} s; "
                     f"sdpa / unfused per pair: median {r['median']:.3f} [min {r['min']:.3f}, "
                     f"max {r['max']:.3f}]")
    return "\n".join(lines)


def main(argv: List[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    with lb.single_rank_layout() as pgs:
        from megatron_mvmoe.platform import seed_all

        seed_all(0)  # Megatron's RNG tracker, forked by dropout
        cores, qkv = build_pair(args, pgs), inputs(args)
        out = report(args, timed_pairs(cores, qkv, args), sdpa_kernels_ran(cores["sdpa"], qkv))
        if args.model_step:
            times = timed_model_pairs(build_models(args, pgs), args)
            out["model_step"] = {"seconds": {n: lb.spread(t) for n, t in times.items()},
                                 "sdpa_over_unfused": lb.pair_ratios(times["sdpa"],
                                                                     times["unfused"])}
    print(json.dumps(out, indent=1) if args.json else text(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
