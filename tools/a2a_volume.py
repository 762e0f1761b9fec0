#!/usr/bin/env python
"""Bytes each MoE collective moves per layer and direction: analytic and counted during a
real forward + backward of the tiny GPT models at EP = 2 and 4 (gloo ranks on CPU), side by
side for baseline latent, Multi-Router, Multi-View, MH-MoE and SMoE, alltoall and allgather.

Checks (exact integer equality): per rank, the forward dispatch and backward combine token
bytes equal the analytic T*k rows; over the EP group the routing-dependent directions sum to
the analytic total; Multi-View / baseline latent = 1.000 on the alltoall dispatcher.
Multi-View on allgather is refused by the layer; its analytic cost (k x) is reported.

Example:
  python tools/a2a_volume.py --ep 2 4 --json > a2a.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mvmoe.analysis import tool_common  # noqa: E402

PRESETS = {"latent": "tiny_latent", "multi_router": "tiny_multi_router",
           "multi_view": "tiny_multi_view", "mh_moe": "tiny_mh_moe", "smoe": "tiny_smoe"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ep", type=int, nargs="+", default=[2, 4], help="EP sizes (= ranks)")
    p.add_argument("--variants", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--dispatchers", nargs="+", default=["alltoall", "allgather"],
                   choices=["alltoall", "allgather"])
    p.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    p.add_argument("--seq-length", type=int, default=16)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--plot", default=None, help="PNG of forward-dispatch bytes per variant")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def _measure_one(variant, dispatcher, ep, args, pg):
    """Forward + backward of one model on this rank under the counter; records + shape."""
    import torch

    from megatron_mvmoe.analysis.a2a_counter import count_collectives
    from megatron_mvmoe.analysis import model_access
    from megatron_mvmoe.training.build import build_trainer

    run = model_access.run_config(PRESETS[variant], overrides={
        "model.seq_length": args.seq_length,
        "model.extra": {"moe_token_dispatcher_type": dispatcher}})
    run.parallel.ep = ep
    trainer = build_trainer(run, pg)
    model = trainer.unwrapped()[0].train()
    rank = torch.distributed.get_rank()
    batch = model_access.synthetic_batches(1, args.batch_size, args.seq_length,
                                           trainer.shape.vocab_size, seed=rank)[0]
    with count_collectives(model) as counter:
        loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss.float().mean().backward()
    config = trainer.config
    shape = dict(tokens=args.batch_size * args.seq_length, hidden=config.hidden_size,
                 topk=config.moe_router_topk, latent=config.latent_size,
                 heads=config.multi_head.num_heads, dtype_bytes=loss.new_empty(
                     0, dtype=config.params_dtype).element_size(),
                 ep=ep, tp=1, experts=config.num_moe_experts)
    return counter.records, shape


def _rank(rank, world_size, args):
    from megatron_mvmoe.analysis.volume import rank_counts
    from megatron_mvmoe.parallel import ParallelLayout, destroy_layout, initialize_layout
    from megatron_mvmoe.platform import apply_cpu_patches

    apply_cpu_patches()
    out = {}
    for dispatcher in args.dispatchers:
        for variant in args.variants:
            pg = initialize_layout(ParallelLayout(ep=world_size))
            try:
                records, shape = _measure_one(variant, dispatcher, world_size, args, pg)
                out[(variant, dispatcher)] = {"counts": rank_counts(records), "shape": shape}
            except (ValueError, NotImplementedError) as err:
                out[(variant, dispatcher)] = {"error": f"{type(err).__name__}: {err}"}
            finally:
                destroy_layout()
    return out


def _combine(ep, per_rank):
    from megatron_mvmoe.analysis.a2a_analytic import CommShape, dispatch_bytes
    from megatron_mvmoe.analysis.volume import checks, per_layer_rows

    results = []
    for (variant, dispatcher), first in per_rank[0].items():
        entry = {"ep": ep, "variant": variant, "dispatcher": dispatcher}
        if "error" in first:
            entry["error"] = first["error"]
            if variant == "multi_view" and dispatcher == "allgather":
                entry["analytic_if_allowed"] = _refused_cost(per_rank[0], ep)
            results.append(entry)
            continue
        shape = CommShape(**first["shape"])
        counts = [r[(variant, dispatcher)]["counts"] for r in per_rank]
        found = checks(variant, dispatcher, shape, counts)
        volume = dispatch_bytes(variant, dispatcher, shape)
        entry.update(shape=first["shape"], analytic_tokens_in=volume.tokens_in,
                     analytic_probs_in=volume.probs_in, rows=per_layer_rows(counts),
                     checks=[c.as_dict() for c in found],
                     all_exact=bool(found) and all(c.ok for c in found))
        results.append(entry)
    return results


def _refused_cost(rank0, ep):
    from megatron_mvmoe.analysis.a2a_analytic import CommShape, dispatch_bytes

    base = rank0.get(("latent", "allgather"), {}).get("shape")
    if base is None:
        return None
    volume = dispatch_bytes("multi_view", "allgather", CommShape(**base))
    return {"tokens_in": volume.tokens_in, "note": volume.note}


def _ratios(results):
    """Counted forward-dispatch token bytes of each variant / the latent baseline."""
    def fwd(entry):
        return sum(r["bytes_per_rank"] for r in entry.get("rows", [])
                   if r["phase"] == "token_dispatch" and r["direction"] == "fwd"
                   and r["payload"] == "tokens")

    out = {}
    for entry in results:
        if entry["dispatcher"] != "alltoall":
            continue
        base = next((e for e in results if e["variant"] == "latent" and e["ep"] == entry["ep"]
                     and e["dispatcher"] == entry["dispatcher"] and "rows" in e), None)
        if base and "rows" in entry and fwd(base):
            out[f"ep{entry['ep']}/{entry['dispatcher']}/{entry['variant']}"] = round(
                fwd(entry) / fwd(base), 6)
    return out


def _summary(payload) -> str:
    lines = []
    for e in payload["results"]:
        head = f"EP={e['ep']} {e['dispatcher']:9s} {e['variant']:13s}"
        if "error" in e:
            lines.append(f"{head} refused: {e['error'][:100]}")
            continue
        bad = [c for c in e["checks"] if not c["ok"]]
        lines.append(f"{head} analytic dispatch/rank {e['analytic_tokens_in']:>7d} B  "
                     f"checks {len(e['checks']) - len(bad)}/{len(e['checks'])} exact")
        for c in bad:
            lines.append(f"    MISMATCH {c['layer']} {c['what']}: counted {c['counted']} "
                         f"analytic {c['analytic']}")
    lines.append("ratio to latent baseline (forward dispatch bytes): " + ", ".join(
        f"{k}={v:.3f}" for k, v in payload["ratios"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_mvmoe.testing.spawn import run_distributed

    start = time.time()
    results = []
    for ep in args.ep:
        per_rank = run_distributed(_rank, ep, timeout_s=args.timeout, args=(args,))
        results += _combine(ep, per_rank)
    payload = {"results": results, "ratios": _ratios(results),
               "all_exact": all(e.get("all_exact", True) for e in results),
               "wall_s": round(time.time() - start, 1),
               "command": " ".join(["python", "tools/a2a_volume.py", *sys.argv[1:]])}
    if args.plot:
        from megatron_mvmoe.analysis.plots import plot_volume

        rows = [{"label": f"EP{e['ep']} {e['dispatcher']} {e['variant']}",
                 "bytes": e["analytic_tokens_in"]} for e in results if "rows" in e]
        payload["plot"] = plot_volume(rows, args.plot, "dispatch bytes per rank per MoE layer")
    tool_common.emit(payload, args.json, _summary(payload))
    return 0 if payload["all_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
