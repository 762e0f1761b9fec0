"""The results page, plot and text summary of `tools/a2a_volume.py --scale` (every figure is
computed from the tool's payload, so the page regenerates with one command)."""

from __future__ import annotations

import json
import os
from typing import Dict, List

from megatron_mvmoe.analysis.a2a.scale import model_shape
from megatron_mvmoe.config.presets import LAYOUTS_10B

_LABEL = {"baseline": "baseline (latent)", "multi_router": "Multi-Router",
          "multi_view": "Multi-View (dedup: blends or views)",
          "naive_multi_view": "naive Multi-View (K views, mixed after)",
          "allgather_baseline": "allgather dispatcher, baseline",
          "allgather_multi_view": "allgather, Multi-View expanded (k x; refused)"}
_SEM = {"row": "row: per (token, expert) [Megatron alltoall]",
        "rank": "rank: per (token, dest rank) [DeepEP]",
        "node": "node: per (token, dest node) + NVLink forward [HybridEP]",
        "allgather": "allgather"}


_SHORT = {"baseline": "base", "multi_router": "MR", "multi_view": "MV",
          "naive_multi_view": "naiveMV", "allgather_baseline": "base"}


def _mb(value: float) -> str:
    return f"{value / 1e6:.2f}"


def plot(payload: dict, path: str) -> str:
    from megatron_mvmoe.analysis.plots import plot_link_bytes

    panels: Dict[str, List[dict]] = {}
    panels: Dict[str, List[dict]] = {}
    off_scale = {}
    for run in payload["runs"]:
        for r in run["rows"]:
            if r["variant"] == "allgather_multi_view":  # k x: would flatten every other bar
                off_scale[r["gpus"]] = r["intra_bytes_mean"] + r["inter_bytes_mean"]
                continue
            title = (f"{run['routing']} routing, {r['gpus']} GPUs (EP {r['ep']}, "
                     f"{r['nodes']} node(s))")
            panels.setdefault(title, []).append({
                "label": f"{r['semantics']}:{_SHORT[r['variant']]}",
                "intra": r["intra_bytes_mean"], "inter": r["inter_bytes_mean"]})
    note = ", ".join(f"{g} GPUs {_mb(v)} MB" for g, v in sorted(off_scale.items()))
    return plot_link_bytes(panels, path, "10B-A1B, one MoE layer, forward dispatch: mean bytes "
                           "a rank sends, intra- vs inter-node (rows + probs + weights + int64 "
                           "bookkeeping)\n"
                           f"not drawn: allgather Multi-View expanded ({note})")


def _total(row: dict) -> float:
    return row["intra_bytes_mean"] + row["inter_bytes_mean"]


def _costlier(rows: List[dict]) -> List[str]:
    """Plain statements: where Multi-View costs more than the baseline, by how much."""
    out = []
    for semantics in ("row", "rank", "node"):
        mv = [r for r in rows if r["variant"] == "multi_view" and r["semantics"] == semantics]
        base = {r["gpus"]: r for r in rows if r["variant"] == "baseline"
                and r["semantics"] == semantics}
        rows_base = {r["gpus"]: r for r in rows if r["variant"] == "baseline"
                     and r["semantics"] == "row"}
        parts = []
        for r in mv:
            points = 100 * (r["a2a_share"] - base[r["gpus"]]["a2a_share"])
            row_base = rows_base[r["gpus"]]
            vs_row = "" if semantics == "row" else (
                f"; vs the baseline on Megatron's rows: bytes x{_total(r) / _total(row_base):.3f}"
                f", time x{r['layer_a2a_ms'] / row_base['layer_a2a_ms']:.3f}")
            parts.append(f"{r['gpus']} GPUs: bytes x{r['bytes_ratio']:.3f} (payload alone "
                         f"x{r['payload_ratio']:.3f}), a2a time "
                         f"x{r['time_ratio']:.3f}, share {100 * base[r['gpus']]['a2a_share']:.1f}% "
                         f"-> {100 * r['a2a_share']:.1f}% ({points:+.1f} points){vs_row}")
        worst = max(r["bytes_ratio"] for r in mv)
        verdict = ("no extra bytes" if worst <= 1.0 + 1e-9 else
                   f"Multi-View costs MORE, up to {100 * (worst - 1):.1f}% more bytes")
        out.append(f"- **{_SEM[semantics]}**: {verdict}. " + "; ".join(parts) + ".")
    return out


def _table(rows: List[dict]) -> List[str]:
    head = ("| GPUs (tp/pp/ep, nodes) | semantic | variant | intra MB | inter MB | of which "
            "bookkeeping MB | max-rank recv MB | layer a2a ms | step a2a ms | step compute ms | "
            "a2a share | bytes / base | payload / base | time / base |")
    out = [head, "|" + "---|" * 14]
    for r in rows:
        out.append(f"| {r['gpus']} ({r['tp']}/{r['pp']}/{r['ep']}, {r['nodes']}) | "
                   f"{r['semantics']} | {_LABEL[r['variant']]} | {_mb(r['intra_bytes_mean'])} | "
                   f"{_mb(r['inter_bytes_mean'])} | {r['bookkeeping_bytes_mean'] / 1e6:.3f} | "
                   f"{_mb(r['max_rank_bytes'])} | "
                   f"{r['layer_a2a_ms']:.3f} | {r['step_a2a_ms']:.2f} | "
                   f"{r['step_compute_ms']:.2f} | {100 * r['a2a_share']:.1f}% | "
                   f"{r['bytes_ratio']:.3f} | {r['payload_ratio']:.3f} | "
                   f"{r['time_ratio']:.3f} |")
    return out


def _model_lines(cfg: dict) -> List[str]:
    m = model_shape("multi_view")
    links = cfg["links"]
    layouts = ", ".join(f"{g} GPUs: tp {v['tp']} pp {v['pp']} ep {v['ep']}"
                        for g, v in LAYOUTS_10B.items() if g in cfg["gpus"])
    return [
        f"- Model (read from `config/presets.py`): {m.num_layers} layers, D = {m.hidden_size}, "
        f"latent L = {m.latent_size}, E = {m.num_experts} experts, top-{m.moe_router_topk}, "
        f"K = {m.multi_view.num_views} views, seq {m.seq_length}; rows bf16 ({cfg['dtype_bytes']} B), "
        "probs and mixing weights fp32.",
        f"- Layouts (`LAYOUTS_10B`): {layouts}; {cfg['gpus_per_node']} GPUs per node, "
        f"ETP = 1 so an EP group fills nodes in rank order; micro-batch {cfg['micro_batch_size']}, "
        "tokens per EP rank = seq x micro-batch / TP.",
        f"- Links: intra-node {links['nvlink_GBps']:.0f} GB/s per direction (NVLink4: 450 GB/s "
        f"datasheet, ~370 achieved by NCCL), inter-node {links['network_GBps']:.0f} GB/s per GPU "
        "(NDR InfiniBand 400 Gb/s = 50 GB/s, ~48 achieved), one NIC per GPU.",
        f"- Compute: analytic training FLOPs (`planning/plan.py`) at {cfg['achieved_tflops']:.0f} "
        "TFLOP/s achieved per GPU; no overlap of compute and communication.",
        "- Time of one collective = max over ranks of max(sent, received) intra bytes / NVLink "
        "+ max(sent, received) inter bytes / network; a layer = dispatch + combine, forward + "
        "backward; a step = layers / PP of them per micro-batch."]


def _routing_text(run: dict, payload: dict) -> str:
    cfg = run["config"]
    if run["routing"] == "balanced":
        return ("balanced: i.i.d. normal logits + top-k (Megatron's "
                "`moe_router_force_load_balancing`).")
    if run["routing"] == "skewed":
        return (f"skewed: Zipf expert popularity p ~ 1/(r+1)^{cfg['load']:g} over a seeded "
                "random expert order, k distinct experts per token drawn by Gumbel top-k.")
    ck = payload.get("checkpoint", {})
    profile = ", ".join(f"{v:.3f}" for v in ck.get("load_profile", []))
    return (f"checkpoint: the trained model's per-expert load shares on held-out text "
            f"(`{ck.get('path')}`, data {ck.get('data')}, {ck.get('tokens')} tokens per layer; "
            f"sorted mean shares [{profile}]), interpolated to E experts and drawn as 'skewed'. "
            "It keeps how uneven the trained router is, not which experts co-occur.")


def _tiny_lines(payload: dict) -> List[str]:
    ck = payload.get("checkpoint")
    if not ck:
        return []
    if "tiny_real_routing" not in ck:  # the load profile came from --profile-json
        return ["", "## The trained tiny model's own routing", "",
                f"Not recomputed: the load profile was read from `{ck.get('profile_json')}`, "
                "not routed through the checkpoint. Run the page's command with --checkpoint "
                "(after `make run`) for this section."]
    out = ["", "## The trained tiny model's own routing", "",
           "Its real routing maps on held-out text split over EP ranks (2 ranks per node), "
           "forward-dispatch bytes over links (float payload + int64 bookkeeping, self "
           "excluded, summed over ranks) of baseline vs "
           "Multi-View for the same maps "
           "(tiny shapes: D, L, top-k of the checkpoint):", "",
           "| layer | EP | semantic | tokens/rank | baseline B (inter) | Multi-View B (inter) "
           "| MV / base |", "|---|---|---|---|---|---|---|"]
    for r in ck["tiny_real_routing"]:
        out.append(f"| {r['layer']} | {r['ep']} | {r['semantics']} | {r['tokens_per_rank']} | "
                   f"{r['baseline_bytes']} ({r['baseline_inter_bytes']}) | "
                   f"{r['multi_view_bytes']} ({r['multi_view_inter_bytes']}) | "
                   f"{r['ratio']:.3f} |")
    out += ["", "The node semantic sends a token over the network once per node and forwards "
            "it over NVLink, so its total link bytes can exceed the row semantic's while its "
            "inter-node bytes are lower."]
    return out


def _counted_lines(path: str) -> List[str]:
    if not path:
        return []
    with open(path) as f:
        counted = json.load(f)
    total = sum(e.get("checks_total", 0) for e in counted["results"])
    exact = sum(e.get("checks_exact", 0) for e in counted["results"])
    ratios = ", ".join(f"{k} = {v:.3f}" for k, v in counted["ratios"].items())
    whole = ", ".join(f"{k} = {v:.3f}" for k, v in counted.get(
        "ratios_with_bookkeeping", {}).items())
    return ["", "## Counted at the collective (tiny GPT, gloo)", "",
            f"`{counted['command']}` ({counted['wall_s']} s): {exact} / {total} checks exact "
            "(counted bytes == analytic bytes per rank, phase, direction, payload and link, "
            "for every semantic, int64 bookkeeping included). Counted forward-dispatch token "
            f"rows over the latent baseline: {ratios}. Everything the forward dispatch sends "
            f"(rows, probs, weights, bookkeeping) over the baseline's: {whole}."]


def write_page(payload: dict, path: str, counted_json: str = None) -> str:
    cfg = payload["runs"][0]["config"]
    lines = ["# All-to-all at cluster scale: 10B-A1B under three dispatch semantics", "",
             f"Generated by `{payload['command']}` ({payload['wall_s']} s on CPU; analytic "
             "bytes from routing maps, see `a2a_model/semantics.py`). Plot: "
             f"`{os.path.basename(payload.get('plot') or 'a2a_at_scale.png')}`.", "",
             "## Set-up", "", *_model_lines(cfg), ""]
    for run in payload["runs"]:
        lines += [f"## Routing: {run['routing']}", "", _routing_text(run, payload), "",
                  "Where Multi-View costs more than the baseline (bytes = mean per rank, "
                  "forward dispatch side, float payload + int64 bookkeeping; payload alone "
                  "in brackets; time = the layer's four collectives, bookkeeping included):",
                  "",
                  *_costlier(run["rows"]), "",
                  "Max-rank load (assignments on the busiest rank / mean): " + ", ".join(
                      f"{r['gpus']} GPUs {r['rank_load_max_over_mean']:.2f}"
                      for r in run["rows"] if r["variant"] == "baseline"
                      and r["semantics"] == "row") + ".", "", *_table(run["rows"]), ""]
    lines += _tiny_lines(payload) + _counted_lines(counted_json)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def text_summary(payload: dict) -> str:
    out = []
    for run in payload["runs"]:
        out.append(f"routing {run['routing']}:")
        out += [f"  {line[2:]}" for line in _costlier(run["rows"])]
    return "\n".join(out)
