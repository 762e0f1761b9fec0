"""Turn `wire_worker` output into measured-vs-predicted rows: inter-node payload bytes per
case, pass (fwd / bwd), node and link direction (tx / rx), and shaped-link times against
`link_time.WireLink`, fitted on some rates and checked on held-out ones.

Prediction of a case's payload on a node link = the analytic bytes of every all-to-all
(`semantics.link_bytes` from the routing maps the run used: rows, probs, mixing weights and
the dedup dispatchers' int64 bookkeeping: split counts, expert ids, (n, mode) pairs) + the
all-gathers (Megatron's tokens-per-expert counts), put on the wire with `wire.rank_matrix`
(gloo's ring; its input sizes as counted, which `link_bytes` states too). The analytic
all-to-all matrices, bookkeeping included, must equal the counted ones exactly
(`analytic_equals_counted`).
"""

from __future__ import annotations

from statistics import median
from typing import Dict, List, Sequence

import torch

from megatron_mvmoe.a2a_model.semantics import link_bytes, payload_for_variant
from megatron_mvmoe.analysis.a2a.link_time import WireLink, collective_wire_time_s, fit_wire_link
from megatron_mvmoe.a2a_model.placement import EpPlacement
from megatron_mvmoe.analysis.a2a.wire import (DIRECTIONS, HEADER_BYTES, WireRecord, counter_delta,
                                          measured_payload, minimal_replay_sizes,
                                          node_link_bytes, rank_matrix, received_split,
                                          relative_error)

PASSES = ("fwd", "bwd")


def _nodes(hosts: Sequence[str]) -> List[int]:
    names = list(dict.fromkeys(hosts))
    return [names.index(h) for h in hosts]


def _records(result: dict) -> List[List[WireRecord]]:
    return [[WireRecord(**{**r, "peer_bytes": tuple(r["peer_bytes"]),
                           "group_ranks": tuple(r["group_ranks"])}) for r in rank["records"]]
            for rank in result["ranks"]]


def _analytic(result: dict, variant: str, semantics: str, ranks_per_node: int):
    """{pass: [P, P]} analytic all-to-all bytes (token, probs and int64 bookkeeping) summed
    over the MoE layers; the all-gathered counts (phase dispatch_preprocess) are left to
    the ring model."""
    shape, ranks = result["ranks"][0]["shape"], result["ranks"]
    placement = EpPlacement(len(ranks), ranks_per_node, shape["experts"])
    payload = payload_for_variant(variant, shape["hidden"], shape["latent"], shape["views"],
                                  shape["dtype_bytes"])
    out = {p: torch.zeros(len(ranks), len(ranks), dtype=torch.long) for p in PASSES}
    for layer in sorted(ranks[0]["maps"]):
        maps_PTE = torch.tensor([r["maps"][layer] for r in ranks], dtype=torch.bool)
        for (phase, direction, _), m in link_bytes(maps_PTE, placement, payload,
                                                   semantics).items():
            if phase != "dispatch_preprocess":
                out[direction] += m
    return out


def case_bytes(result: dict, hosts: Sequence[str], ranks_per_node: int,
               header_bytes: int = HEADER_BYTES) -> dict:
    """Predicted vs measured payload of one case: rows per pass, node and direction."""
    case, node_of = result["case"], _nodes(hosts)
    records, world = _records(result), len(hosts)
    analytic = _analytic(result, case["variant"], case["semantics"], ranks_per_node)
    rows, exact = [], True
    for p in PASSES:
        mine = [[r for r in recs if r.direction == p] for recs in records]
        a2a = rank_matrix([[r for r in rs if r.op == "all_to_all_single"] for rs in mine], world)
        gathers = rank_matrix([[r for r in rs if r.op != "all_to_all_single"] for rs in mine],
                              world)
        meta = rank_matrix([[r for r in rs if r.payload == "metadata"] for rs in mine], world)
        exact &= torch.equal(a2a, analytic[p])
        predicted = node_link_bytes(analytic[p] + gathers, node_of)
        meta_nodes = node_link_bytes(meta, node_of)
        replay_pred = node_link_bytes(rank_matrix([minimal_replay_sizes(rs) for rs in mine],
                                                  world), node_of)
        rows += _measured_rows(result, p, predicted, meta_nodes, replay_pred, hosts,
                               header_bytes)
    worst = max(abs(r["error"]) for r in rows)
    return {"case": case, "rows": rows, "analytic_equals_counted": bool(exact),
            "max_abs_error": worst, "outside_dispatchers": result["ranks"][0][
                "outside_dispatchers"], "views_mode_pairs": views_mode_pairs(result, ranks_per_node),
            "max_experts_on_one_rank": _max_n(result, ranks_per_node)}


def _max_n(result: dict, ranks_per_node: int) -> int:
    shape, ranks = result["ranks"][0]["shape"], result["ranks"]
    per_rank = shape["experts"] // len(ranks)
    return max(int(torch.tensor([r["maps"][layer] for r in ranks], dtype=torch.long)
                   .reshape(len(ranks), -1, len(ranks), per_rank).sum(-1).max())
               for layer in ranks[0]["maps"])


def views_mode_pairs(result: dict, ranks_per_node: int) -> int:
    """(token, destination rank) pairs that the dedup dispatcher sends as K views + weights
    (Multi-View with n experts on one rank where that is cheaper than n blends)."""
    from megatron_mvmoe.functional.mixing import views_are_cheaper

    shape, ranks = result["ranks"][0]["shape"], result["ranks"]
    if result["case"]["variant"] != "multi_view" or result["case"]["semantics"] == "row":
        return 0
    placement = EpPlacement(len(ranks), ranks_per_node, shape["experts"])
    total = 0
    for layer in ranks[0]["maps"]:
        maps_PTE = torch.tensor([r["maps"][layer] for r in ranks], dtype=torch.long)
        n = maps_PTE.reshape(*maps_PTE.shape[:2], placement.ep, -1).sum(-1)
        total += int((views_are_cheaper(n, shape["views"], shape["latent"],
                                        shape["dtype_bytes"], 4) & (n > 0)).sum())
    return total


def _measured_rows(result, p, predicted, meta_nodes, replay_pred, hosts,
                   header_bytes) -> List[dict]:
    index = 1 if p == "fwd" else 2
    rows = []
    for rank, info in enumerate(result["ranks"]):
        if not info["reader"]:
            continue
        node = _nodes(hosts)[rank]
        per_repeat = []
        for model, replay in zip(info["windows"]["model"], info["windows"]["replay"]):
            per_repeat.append(measured_payload(
                counter_delta(model[index - 1], model[index]),
                counter_delta(replay[index - 1], replay[index]), replay_pred[node],
                header_bytes))
        for d in DIRECTIONS:
            med = {k: median(m[d][k] for m in per_repeat) for k in per_repeat[0][d]}
            spread = [m[d]["payload"] for m in per_repeat]
            rows.append({"pass": p, "node": info["node"], "direction": d,
                         "predicted": predicted[node][d], "metadata": meta_nodes[node][d],
                         "measured": med["payload"], "measured_min": min(spread),
                         "measured_max": max(spread), "headers": med["headers"],
                         "control": med["control"], "frame_bytes": med["bytes"],
                         "packets": med["packets"],
                         "error": relative_error(med["payload"], predicted[node][d])})
    return rows


def case_summary(entry: dict) -> Dict[str, dict]:
    """Totals over nodes per (pass, direction)."""
    out = {}
    for p in PASSES:
        for d in DIRECTIONS:
            rows = [r for r in entry["rows"] if r["pass"] == p and r["direction"] == d]
            predicted, measured = sum(r["predicted"] for r in rows), sum(r["measured"]
                                                                         for r in rows)
            out[f"{p}/{d}"] = {"predicted": predicted, "measured": measured,
                               "headers": sum(r["headers"] for r in rows),
                               "control": sum(r["control"] for r in rows),
                               "error": relative_error(measured, predicted)}
    return out


# ---- time on shaped links --------------------------------------------------------------------
def timing_samples(result: dict, hosts: Sequence[str]) -> List[dict]:
    """One sample per (rate, layer/direction): measured seconds (max over ranks per repeat;
    median and spread over repeats), the busiest node link's bytes per collective, and
    each rank's received bytes over the sample's collectives, intra / inter-node."""
    ranks, node_of = result["ranks"], _nodes(hosts)
    if not ranks[0].get("timing"):
        return []
    records, world = _records(result), len(hosts)
    samples = []
    for rate, per_key in ranks[0]["timing"].items():
        for key in per_key:
            layer, direction = key.rsplit("/", 1)
            reps = [max(r["timing"][rate][key][i] for r in ranks)
                    for i in range(len(per_key[key]))]
            picked = [i for i, r in enumerate(records[0])
                      if r.layer == layer and r.direction == direction]
            collectives = []
            for i in picked:
                nodes = node_link_bytes(rank_matrix([[recs[i]] for recs in records], world),
                                        node_of)
                busiest = max(max(v["tx"], v["rx"]) for v in nodes.values())
                collectives.append((busiest, len(records[0][i].group_ranks) - 1))
            received = received_split(rank_matrix([[recs[i] for i in picked]
                                                   for recs in records], world), node_of)
            samples.append({"case": result["case"], "rate_bps": float(rate) * 1e6,
                            "key": key, "seconds": median(reps), "min_s": min(reps),
                            "max_s": max(reps), "repeats": len(reps),
                            "collectives": collectives, "received": received})
    return samples


def predict(sample: dict, link: WireLink) -> float:
    return sum(collective_wire_time_s({0: {"tx": b, "rx": b}}, m, link)
               for b, m in sample["collectives"])


def receive_bandwidth(samples: List[dict]) -> dict:
    """Receive-side bandwidth as HybridEP / NCCL EP report it: bytes the busiest receiving
    rank got from other ranks over the measured time, intra- and inter-node (GB/s, median
    over the samples); {} for samples recorded before it was kept."""
    if not samples or any("received" not in s for s in samples):
        return {}
    return {f"recv_{link}_GBps_median": median(max(s["received"][link]) / s["seconds"] / 1e9
                                               for s in samples) for link in ("intra", "inter")}


def time_model_report(samples: List[dict], fit_rates_mbit: Sequence[float]) -> dict:
    """The plain model (efficiency 1, no per-message cost) and the model fitted on
    `fit_rates_mbit`, with errors per rate; held-out rates are the others."""
    fit_on = [s for s in samples if s["rate_bps"] / 1e6 in set(fit_rates_mbit)]
    efficiency, per_message = fit_wire_link(fit_on)
    per_rate = {}
    for rate in sorted({s["rate_bps"] for s in samples}):
        mine = [s for s in samples if s["rate_bps"] == rate]
        plain = [relative_error(predict(s, WireLink(rate)), s["seconds"]) for s in mine]
        fitted = [relative_error(predict(s, WireLink(rate, efficiency,
                                                     per_message_s=per_message)), s["seconds"])
                  for s in mine]
        per_rate[f"{rate / 1e6:g}"] = {
            "held_out": rate / 1e6 not in set(fit_rates_mbit), "samples": len(mine),
            **receive_bandwidth(mine),
            "measured_median_s": median(s["seconds"] for s in mine),
            "plain_model_error_mean_abs": sum(map(abs, plain)) / len(plain),
            "fitted_error_mean_abs": sum(map(abs, fitted)) / len(fitted),
            "fitted_error_max_abs": max(map(abs, fitted))}
    return {"efficiency": efficiency, "per_message_s": per_message,
            "fit_rates_mbit": list(fit_rates_mbit), "per_rate": per_rate}
