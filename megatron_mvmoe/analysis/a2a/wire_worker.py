"""One rank of `tools/a2a_wire.py`: started by srun on every node, measures the node link's
counters around windows holding only the MoE layers' dispatch and combine.

    python -m megatron_mvmoe.analysis.a2a.wire_worker SPEC.json   # under srun; rank 0 writes
                                                              # spec["out"]

Per case (variant, dispatch semantics): build the tiny model at EP = world, run one
forward + backward under the collective counter (records: what each rank handed to
torch.distributed), then `repeats` times: [read] forward [read] backward [read], each read
between two barriers, so a window holds the MoE collectives, two barrier halves and nothing
else (EP-only model without DDP: the MoE layers are the only communication). The same
windows replay the recorded collectives at minimal size (analysis.a2a.wire: transport overhead),
and, with `time` in the spec, the recorded collectives of each layer and direction are
replayed at full size under `tc tbf` rates and timed.

Design choices:
- Only local rank 0 of a node reads the node's counters (one link per node); every rank
  reads the same interface, found as the one holding the address gloo binds to (the host
  name's), or the one the spec names (`iface`: a real cluster's fabric NIC, which should
  also be gloo's: GLOO_SOCKET_IFNAME).
- tc: local rank 0 of each node sets its node's egress rate, and the switch side's egress
  towards its node when the spec names the bridge namespace (the local cluster); on a real
  cluster the spec has no rates and nothing is shaped.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from megatron_mvmoe.analysis.a2a.wire import A2A_OPS, WireRecord, minimal_replay_sizes


def find_iface(address: str) -> str:
    """The interface holding `address` (`ip -o addr`)."""
    out = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if fields[3].split("/")[0] == address:
            return fields[1]
    raise ValueError(f"iface: no interface holds {address} (the address of "
                     f"{socket.gethostname()}). Fix: pass --iface NAME")


def read_iface(iface: str) -> Dict[str, int]:
    for line in open("/proc/net/dev").read().splitlines()[2:]:
        name, _, fields = line.partition(":")
        if name.strip() == iface:
            v = [int(x) for x in fields.split()]
            return {"rx_bytes": v[0], "rx_packets": v[1], "tx_bytes": v[8], "tx_packets": v[9]}
    raise ValueError(f"iface: {iface!r} not in /proc/net/dev. Fix: pass an existing --iface")


class Link:
    """This rank's view of its node link: counters (local rank 0 reads) and tc."""

    def __init__(self, spec: dict, local_rank: int) -> None:
        host = socket.gethostname()
        self.node = host
        self.iface = spec.get("iface") or (spec.get("links") or {}).get(host) or find_iface(
            socket.gethostbyname(host))
        self.reader = local_rank == 0
        self.bridge = spec.get("bridge_ns")
        self.port = (spec.get("ports") or {}).get(host)

    def sync_read(self) -> Optional[Dict[str, int]]:
        dist.barrier()
        value = read_iface(self.iface) if self.reader else None
        dist.barrier()
        return value

    def shape(self, rate_mbit: Optional[float], burst_kb: int, latency_ms: float = 20) -> None:
        if self.reader:
            for prefix, dev in ((), self.iface), (("ip", "netns", "exec", self.bridge),
                                                  self.port):
                if dev is None or (prefix and not self.bridge):
                    continue
                cmd = ([*prefix, "tc", "qdisc", "del", "dev", dev, "root"] if rate_mbit is None
                       else [*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                             "rate", f"{rate_mbit}mbit", "burst", f"{burst_kb}kb",
                             "latency", f"{latency_ms}ms"])
                subprocess.run(cmd, capture_output=True, check=rate_mbit is not None)
        dist.barrier()


def build(case: dict, spec: dict, world: int, ranks_per_node: int):
    from megatron_mvmoe.models.build import build_model
    from megatron_mvmoe.parallel import ParallelLayout, initialize_layout
    from megatron_mvmoe.toolkit import checkpoint, heldout

    overrides = {"model.seq_length": spec["seq_length"],
                 "model.extra": {"moe_token_dispatcher_type": "alltoall"}}
    if case["semantics"] != "row":  # the registry's dedup dispatcher, chosen by the config
        overrides.update({"model.moe_dispatcher": f"dedup_{case['semantics']}",
                          "model.moe_dispatch_ranks_per_node": ranks_per_node})
    overrides.update(case.get("overrides") or {})
    run = checkpoint.run_config(f"tiny_{case['variant']}", overrides=overrides)
    run.parallel.ep = world
    pg = initialize_layout(ParallelLayout(ep=world))
    model = build_model(run, pg)[0].train()
    rank = dist.get_rank()
    batch = heldout.synthetic_batches(1, spec["batch_size"], spec["seq_length"],
                                      run.model.vocab_size, seed=spec.get("seed", 0)
                                           + rank)[0]
    return model, batch


def forward(model, batch):
    loss = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return loss.float().mean()


def replay(records: List[WireRecord], group, outputs: Optional[List[list]] = None) -> None:
    """Issue the recorded collectives again (all ranks in the same order); `outputs` gives
    each all-to-all's output splits in bytes, None = minimal replay (zero splits)."""
    for i, r in enumerate(records):
        dtype = getattr(torch, r.dtype)
        size = torch.empty(0, dtype=dtype).element_size()
        if r.op in A2A_OPS:
            send = [b // size for b in r.peer_bytes]
            recv = [b // size for b in outputs[i]] if outputs else [0] * len(send)
            x, y = torch.zeros(sum(send), dtype=dtype), torch.empty(sum(recv), dtype=dtype)
            dist.all_to_all_single(y, x, recv, send, group=group)
        else:
            n = r.input_bytes // size
            x = torch.zeros(n, dtype=dtype)
            dist.all_gather_into_tensor(torch.empty(n * len(r.group_ranks), dtype=dtype), x,
                                        group=group)


def output_splits(all_records: List[List[WireRecord]], rank: int, picked: List[int]):
    """Bytes each source rank sends this rank in each picked all-to-all."""
    out = []
    for i in picked:
        r = all_records[rank][i]
        if r.op not in A2A_OPS:
            out.append(None)
            continue
        where = list(r.group_ranks).index(rank)
        out.append([all_records[src][i].peer_bytes[where] for src in r.group_ranks])
    return out


def measure_case(case: dict, spec: dict, link: Link, world: int, ranks_per_node: int) -> dict:
    from megatron_mvmoe.analysis.a2a.counter import count_collectives
    from megatron_mvmoe.parallel import destroy_layout

    model, batch = build(case, spec, world, ranks_per_node)
    try:
        forward(model, batch).backward()  # warm-up: lazy state, first-use allocations
        with count_collectives(model) as counter:
            forward(model, batch).backward()
        records = [WireRecord.of(r) for r in counter.records]
        group = next(m.token_dispatcher.ep_group for m in model.modules()
                     if getattr(m, "token_dispatcher", None) is not None)
        maps = {name: m.token_dispatcher.routing_map.clone().tolist()
                for name, m in model.named_modules()
                if getattr(getattr(m, "token_dispatcher", None), "routing_map", None)
                is not None}
        by_dir = {d: [r for r in records if r.direction == d] for d in ("fwd", "bwd")}
        minimal = {d: minimal_replay_sizes(v) for d, v in by_dir.items()}
        windows = {"model": [], "replay": [], "empty": []}
        for _ in range(spec["repeats"]):
            c0 = link.sync_read()
            loss = forward(model, batch)
            c1 = link.sync_read()
            loss.backward()
            windows["model"].append([c0, c1, link.sync_read()])
            c0 = link.sync_read()
            replay(minimal["fwd"], group)
            c1 = link.sync_read()
            replay(minimal["bwd"], group)
            windows["replay"].append([c0, c1, link.sync_read()])
            windows["empty"].append([link.sync_read(), link.sync_read()])
        timing = time_layers(records, group, spec, link) if spec.get("time") else None
        cfg = model.config
        return {"records": records, "windows": windows, "maps": maps, "timing": timing,
                "outside_dispatchers": sum(1 for r in counter.records if r.layer is None),
                "shape": {"hidden": cfg.hidden_size, "latent": cfg.latent_size,
                          "views": cfg.multi_view.num_views, "experts": cfg.num_moe_experts,
                          "topk": cfg.moe_router_topk,
                          "dtype_bytes": torch.empty(0, dtype=cfg.params_dtype).element_size()}}
    finally:
        destroy_layout()


def time_layers(records: List[WireRecord], group, spec: dict, link: Link) -> dict:
    """Seconds of each (layer, direction)'s recorded collectives replayed at full size, per
    tbf rate: {rate: {layer/direction: [seconds per repeat on this rank]}}."""
    world, rank = dist.get_world_size(), dist.get_rank()
    all_records: List[List[WireRecord]] = [None] * world
    dist.all_gather_object(all_records, records)
    keys = sorted({(r.layer, r.direction) for r in records})
    cfg = spec["time"]
    out: Dict[str, dict] = {}
    try:
        for rate in cfg["rates_mbit"]:
            link.shape(rate, cfg.get("burst_kb", 64), cfg.get("latency_ms", 20))
            per_key = {}
            for layer, direction in keys:
                picked = [i for i, r in enumerate(records)
                          if r.layer == layer and r.direction == direction]
                chosen = [records[i] for i in picked]
                outs = output_splits(all_records, rank, picked)
                replay(chosen, group, outs)  # warm-up at this rate (TCP windows open up)
                seconds = []
                for _ in range(cfg["repeats"]):
                    dist.barrier()
                    t0 = time.perf_counter()
                    replay(chosen, group, outs)
                    seconds.append(time.perf_counter() - t0)
                per_key[f"{layer}/{direction}"] = seconds
            out[str(rate)] = per_key
    finally:
        link.shape(None, 0)
    return out


def _jsonable(result: dict) -> dict:
    out = dict(result)
    out["records"] = [r.__dict__ for r in result["records"]]
    return out


def main(spec_path: str) -> int:
    from megatron_mvmoe.launch.init import init_distributed
    from megatron_mvmoe.platform import apply_cpu_patches

    spec = json.load(open(spec_path))
    rdzv = init_distributed(backend="gloo", timeout_s=spec.get("timeout_s", 120))
    apply_cpu_patches()
    world, rank = dist.get_world_size(), dist.get_rank()
    link = Link(spec, rdzv.local_rank)
    hosts: List[str] = [None] * world
    dist.all_gather_object(hosts, link.node)
    ranks_per_node = world // len(set(hosts))
    results = []
    for case in spec["cases"]:
        if rank == 0:
            print(f"[wire_worker] {case}", file=sys.stderr, flush=True)
        started = time.time()
        found = measure_case(case, spec, link, world, ranks_per_node)
        gathered: List[dict] = [None] * world
        dist.all_gather_object(gathered, {**_jsonable(found), "node": link.node,
                                          "reader": link.reader, "iface": link.iface})
        results.append({"case": case, "ranks": gathered, "wall_s": time.time() - started})
    if rank == 0:
        with open(spec["out"], "w") as fh:
            json.dump({"hosts": hosts, "ranks_per_node": ranks_per_node, "world": world,
                       "results": results}, fh)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
