#!/usr/bin/env python
"""The MoE all-to-all on the wire: inter-node payload bytes read from each node's interface
counters next to the analytic prediction, and all-to-all times on links of set rate (tc
tbf) next to analysis/a2a/link_time.py's model, on a real Slurm cluster of namespaced nodes.

Bytes: for each layout (NODESxRANKS: 2x1 = EP 2 over 2 nodes, 2x2 = EP 4 over 2 nodes x 2
ranks, 4x1 = EP 4 over 4 nodes) one srun job runs, per case (latent, Multi-Router,
Multi-View, SMoE x Megatron's alltoall rows / dedup per rank / dedup per node, plus a
Multi-View routing with >= 3 experts of a token on one rank: the dedup views mode), the MoE
forward and backward between counter reads (analysis/a2a/wire_worker.py). Payload = TCP payload
(bytes - 66 x packets) minus gloo's control messages (a minimal-size replay of the same
collectives); goal: within --tolerance of the prediction on every node, pass and direction.
Time (--time): the recorded collectives of each layer and direction replayed at full size
with every node link shaped to each --rates-mbit; the model fitted on --fit-rates-mbit must
predict the other rates within 10 %.

The cluster (megatron_mvmoe.dev_cluster.Cluster; tools/slurm_local.py --instance I) is
started here and always stopped, its namespaces and tc rules removed, also when the run
fails or is killed (a reaper process stops it once this process is gone, SIGKILL included).

Examples:
  python tools/a2a_wire.py --json > wire.json                     # every layout and case
  python tools/a2a_wire.py --layouts 2x1 --variants latent --semantics row --json
  python tools/a2a_wire.py --layouts 2x1 --time --markdown examples/results/a2a_wire.md \\
      --plot examples/results/a2a_wire.png --json
  python tools/a2a_wire.py --analyse out_dir/worker_2x1.json --json  # a real cluster's run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_mvmoe.config.variants import get_variant
from megatron_mvmoe.toolkit import output

REPO = Path(__file__).resolve().parents[1]

VARIANTS = ("latent", "multi_router", "multi_view", "smoe")
SEMANTICS = ("row", "rank", "node")
LAYOUTS = ("2x1", "2x2", "4x1")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS),
                   help="NODESxRANKS_PER_NODE (nodes 2..4, ranks 1 or 2)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--semantics", nargs="+", default=list(SEMANTICS), choices=SEMANTICS,
                   help="row = Megatron's alltoall dispatcher; rank / node = the dedup one")
    p.add_argument("--no-views-case", action="store_true",
                   help="skip the Multi-View routing with >= 3 experts per destination")
    p.add_argument("--batch-size", type=int, default=2, help="bytes: sequences per rank")
    p.add_argument("--seq-length", type=int, default=64, help="bytes: tokens per sequence")
    p.add_argument("--repeats", type=int, default=5, help="bytes: windows per case (median)")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="largest relative payload error accepted")
    p.add_argument("--time", action="store_true", help="also time the a2a on shaped links")
    p.add_argument("--skip-bytes", action="store_true",
                   help="with --time: only the timing job (no byte layouts)")
    p.add_argument("--time-layout", default="2x1")
    p.add_argument("--time-cases", nargs="+", default=["latent:row", "smoe:row",
                                                       "multi_view:rank"],
                   help="VARIANT:SEMANTICS timed (multi_view uses the views routing)")
    p.add_argument("--rates-mbit", type=float, nargs="+", default=[200, 500, 1000, 2000, 5000])
    p.add_argument("--fit-rates-mbit", type=float, nargs="+", default=[200, 1000, 5000],
                   help="rates the efficiency and per-message cost are fitted on")
    p.add_argument("--time-batch-size", type=int, default=16)
    p.add_argument("--time-seq-length", type=int, default=256)
    p.add_argument("--time-repeats", type=int, default=7)
    p.add_argument("--burst-kb", type=int, default=64, help="tbf bucket (>= a GSO frame)")
    p.add_argument("--tbf-latency-ms", type=float, default=20,
                   help="tbf queue length as time at the rate: a short queue keeps one "
                        "direction's ACKs from waiting behind the other's data (bufferbloat)")
    p.add_argument("--instance", type=int, default=1,
                   help="cluster instance (own namespaces, subnet, ports; see slurm_local)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per srun job")
    p.add_argument("--out-dir", default=None, help="keep specs, worker output and logs here")
    p.add_argument("--analyse", nargs="+", default=None,
                   help="only analyse worker output files (e.g. from a real cluster)")
    p.add_argument("--write-spec", default=None,
                   help="real cluster: only write the worker spec for --layouts' first entry "
                        "(or this Slurm job's nodes x tasks) here, output to --worker-out")
    p.add_argument("--worker-out", default=None, help="--write-spec: worker output path")
    p.add_argument("--iface", default=None,
                   help="--write-spec: the NIC to read (default: the one holding the host "
                        "name's address)")
    p.add_argument("--header-bytes", type=int, default=66,
                   help="frame header bytes per packet: 66 Ethernet+IPv4+TCP timestamps; "
                        "56 on IPoIB")
    p.add_argument("--markdown", default=None, help="write the results page here")
    p.add_argument("--plot", default=None, help="PNG: measured vs predicted bytes and times")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    return p.parse_args(argv)


def _progress(message: str) -> None:
    print(f"[a2a_wire] {message}", file=sys.stderr, flush=True)


def parse_layout(text: str):
    from megatron_mvmoe.errors import require

    parts = text.split("x")
    ok = len(parts) == 2 and all(x.isdigit() for x in parts)
    require(ok, "--layouts", f"{text!r} is not NODESxRANKS", "write e.g. 2x1, 2x2 or 4x1")
    nodes, ranks = int(parts[0]), int(parts[1])
    require(2 <= nodes <= 4 and ranks in (1, 2), "--layouts", f"{text!r}: {nodes} nodes x "
            f"{ranks} ranks", "use 2..4 nodes and 1 or 2 ranks per node")
    return nodes, ranks


def views_overrides(ep: int) -> dict:
    """Four experts per rank and top-4: tokens often have >= 3 experts on one rank, where
    K = 2 views + n x K weights are smaller than n blends (the dedup views mode)."""
    return {"model.num_experts": 4 * ep, "model.moe_router_topk": 4}


def cases_for(args, nodes: int, ranks: int) -> list:
    out = []
    for semantics in args.semantics:
        if semantics == "node" and ranks == 1:
            continue  # one rank per node: the node semantic is the rank one
        out += [{"variant": v, "semantics": semantics} for v in args.variants]
        if semantics != "row" and "multi_view" in args.variants and not args.no_views_case:
            out.append({"variant": "multi_view", "semantics": semantics, "views_case": True,
                        "overrides": views_overrides(nodes * ranks)})
    return out


def time_cases(args, ep: int) -> list:
    out = []
    for item in args.time_cases:
        variant, _, semantics = item.partition(":")
        case = {"variant": variant, "semantics": semantics or "row"}
        if get_variant(variant).multi_view and case["semantics"] != "row":
            case.update(views_case=True, overrides=views_overrides(ep))
        out.append(case)
    return out


def write_spec(args) -> int:
    """A worker spec for the current Slurm job (a real cluster: no tc, real NIC)."""
    env = os.environ
    if env.get("SLURM_JOB_NUM_NODES") and env.get("SLURM_NTASKS_PER_NODE"):
        nodes, ranks = int(env["SLURM_JOB_NUM_NODES"]), int(env["SLURM_NTASKS_PER_NODE"])
    else:
        nodes, ranks = parse_layout(args.layouts[0])
    spec = {"batch_size": args.batch_size, "seq_length": args.seq_length,
            "repeats": args.repeats, "timeout_s": 300, "iface": args.iface,
            "cases": cases_for(args, nodes, ranks),
            "out": args.worker_out or str(Path(args.write_spec).with_name("worker.json"))}
    Path(args.write_spec).write_text(json.dumps(spec, indent=1))
    print(json.dumps({"spec": args.write_spec, "nodes": nodes, "ranks_per_node": ranks,
                      "cases": len(spec["cases"]), "out": spec["out"]}))
    return 0


# ---- the cluster -----------------------------------------------------------------------------
class Terminated(Exception):
    """SIGTERM / SIGHUP arrived: unwind so the cluster is stopped."""


def _on_signal(signum, _frame):
    raise Terminated(f"signal {signum}")


def detect_netem(c) -> dict:
    """Try a netem qdisc on a bridge port (inside our namespace); remove it if it worked."""
    dev = c.port(c.names[0])
    cmd = ["ip", "netns", "exec", c.bridge_ns, "tc", "qdisc", "add", "dev", dev, "root",
           "netem", "delay", "1ms"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode == 0:
        subprocess.run(["ip", "netns", "exec", c.bridge_ns, "tc", "qdisc", "del", "dev", dev,
                        "root"], capture_output=True)
    return {"available": out.returncode == 0, "probe": " ".join(cmd),
            "answer": out.stderr.strip() or "ok",
            "consequence": None if out.returncode == 0 else
            "no link latency can be emulated: the model's latency term stays 0 and the "
            "per-message cost absorbs the real (veth, microseconds) latency"}


def run_job(c, state, nodes: int, ranks: int, spec: dict, out_dir: Path, name: str,
            timeout: float) -> dict:
    from megatron_mvmoe.dev_cluster import netns as ns

    spec = {**spec, "out": str(out_dir / f"worker_{name}.json"),
            "links": {n: c.veth(n) for n in c.names}, "bridge_ns": c.bridge_ns,
            "ports": {n: c.port(n) for n in c.names}}
    spec_path = out_dir / f"spec_{name}.json"
    spec_path.write_text(json.dumps(spec))
    log = out_dir / f"job_{name}.log"
    cmd = [*c.client_prefix(), "srun", f"--partition={c.partition}", f"--nodes={nodes}",
           f"--ntasks-per-node={ranks}", "--cpus-per-task=1", "--kill-on-bad-exit=1",
           f"--job-name=a2a_wire_{name}", "--export=ALL,OMP_NUM_THREADS=1",
           sys.executable, "-m", "megatron_mvmoe.analysis.a2a.wire_worker", str(spec_path)]
    started = time.time()
    with open(log, "w") as fh:
        done = subprocess.run(cmd, cwd=REPO, env=ns.client_env(state), stdout=fh,
                              stderr=subprocess.STDOUT, timeout=timeout)
    if done.returncode != 0:
        tail = log.read_text()[-2000:]
        raise RuntimeError(f"srun job {name} failed (rc {done.returncode}); log {log}:\n{tail}")
    return {"output": json.loads(Path(spec["out"]).read_text()), "wall_s": time.time() - started}


def run_on_cluster(args, out_dir: Path) -> dict:
    from megatron_mvmoe.dev_cluster import Cluster

    layouts = [] if args.skip_bytes and args.time else [parse_layout(x) for x in args.layouts]
    nodes = max([n for n, _ in layouts] + ([parse_layout(args.time_layout)[0]]
                                           if args.time else []))
    cluster = Cluster(nodes, args.instance)
    c, state = cluster.layout, cluster.state
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    reaper = None
    payload = {"cluster": {"nodes": nodes, "instance": args.instance,
                           "namespaces": c.all_netns(), "subnet": c.subnet + ".0/24"},
               "layouts": [], "timing": None}
    try:
        started = time.time()
        cluster.start()
        reaper = cluster.spawn_reaper(os.getpid())
        payload["cluster"]["start_s"] = round(time.time() - started, 1)
        payload["netem"] = detect_netem(c)
        base = {"batch_size": args.batch_size, "seq_length": args.seq_length,
                "repeats": args.repeats, "timeout_s": 120}
        for (n, r), text in zip(layouts, args.layouts):
            _progress(f"layout {text}: {n} nodes x {r} ranks")
            job = run_job(c, state, n, r, {**base, "cases": cases_for(args, n, r)}, out_dir,
                          text, args.timeout)
            payload["layouts"].append({"layout": text, "wall_s": round(job["wall_s"], 1),
                                       "worker": job["output"]})
        if args.time:
            n, r = parse_layout(args.time_layout)
            _progress(f"timing on {args.time_layout} at {args.rates_mbit} Mbit/s")
            spec = {"batch_size": args.time_batch_size, "seq_length": args.time_seq_length,
                    "repeats": 1, "timeout_s": 300, "cases": time_cases(args, n * r),
                    "time": {"rates_mbit": args.rates_mbit, "repeats": args.time_repeats,
                             "burst_kb": args.burst_kb, "latency_ms": args.tbf_latency_ms}}
            job = run_job(c, state, n, r, spec, out_dir, f"time_{args.time_layout}",
                          args.timeout)
            payload["timing"] = {"layout": args.time_layout, "wall_s": round(job["wall_s"], 1),
                                 "tbf": {"burst_kb": args.burst_kb,
                                         "latency_ms": args.tbf_latency_ms},
                                 "worker": job["output"]}
    finally:
        if reaper:
            _end(reaper)
        down = cluster.stop()
        payload["cluster"]["left_after_stop"] = {
            "namespaces": [k for k, v in down["netns"].items() if v],
            "daemons": [k for k, v in down["alive"].items() if v]}
    return payload


def _end(pid: int) -> None:
    """Stop our reaper (we stop the cluster ourselves; a late reaper could stop a new one)."""
    try:
        os.kill(pid, signal.SIGTERM)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass


# ---- analysis --------------------------------------------------------------------------------
def analyse(payload: dict, args) -> dict:
    from megatron_mvmoe.analysis.a2a.wire_report import (case_bytes, case_summary, time_model_report,
                                                     timing_samples)

    rows = []
    for layout in payload["layouts"]:
        w = layout["worker"]
        for result in w["results"]:
            entry = case_bytes(result, w["hosts"], w["ranks_per_node"], args.header_bytes)
            entry.update(layout=layout["layout"], summary=case_summary(entry),
                         wall_s=round(result["wall_s"], 2))
            entry["within_tolerance"] = entry["max_abs_error"] <= args.tolerance
            rows.append(entry)
    payload["cases"] = rows
    payload["tolerance"] = args.tolerance
    payload["all_within_tolerance"] = bool(rows) and all(r["within_tolerance"] for r in rows)
    if payload.get("timing"):
        w = payload["timing"]["worker"]
        samples = [s for result in w["results"] for s in timing_samples(result, w["hosts"])]
        payload["timing"].update(samples=samples,
                                 model=time_model_report(samples, args.fit_rates_mbit))
        payload["timing"].pop("worker")
    for layout in payload["layouts"]:
        layout.pop("worker")
    return payload


def text_summary(payload: dict) -> str:
    lines = [f"payload on the wire vs prediction (tolerance {payload['tolerance']:.1%}); bytes "
             "summed over nodes; overhead = headers + gloo control"]
    for e in payload["cases"]:
        c = e["case"]
        name = f"{e['layout']} {c['semantics']:4s} {c['variant']}{' (views)' if c.get('views_case') else ''}"
        for key, s in e["summary"].items():
            lines.append(f"{name:34s} {key:7s} predicted {s['predicted']:>9d} measured "
                         f"{s['measured']:>11.0f} overhead {s['headers'] + s['control']:>8.0f} "
                         f"error {s['error']:+.4%}")
        lines.append(f"{'':34s} max |error| over nodes {e['max_abs_error']:.4%}"
                     f"{'' if e['within_tolerance'] else '  OVER TOLERANCE'}")
    t = payload.get("timing")
    if t:
        m = t["model"]
        lines.append(f"time model: efficiency {m['efficiency']:.3f}, per message "
                     f"{m['per_message_s'] * 1e6:.0f} us, fitted on {m['fit_rates_mbit']} Mbit/s")
        for rate, r in m["per_rate"].items():
            lines.append(f"  {rate:>6s} Mbit/s{' (held out)' if r['held_out'] else ''}: plain "
                         f"model error {r['plain_model_error_mean_abs']:.1%}, fitted mean "
                         f"{r['fitted_error_mean_abs']:.1%} max {r['fitted_error_max_abs']:.1%}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    try:
        for text in args.layouts:
            parse_layout(text)
        if args.write_spec:
            return write_spec(args)
        if args.analyse:
            payload = {"layouts": [{"layout": Path(f).stem, "wall_s": None,
                                    "worker": json.loads(Path(f).read_text())}
                                   for f in args.analyse], "timing": None}
        else:
            if os.geteuid() != 0 or not shutil.which("slurmctld"):
                return output.fail("the namespaced cluster needs root and slurm-wlm. "
                                        "Fix: run as root with slurm-wlm and munge installed, "
                                        "or --analyse a real cluster's worker output")[0]
            out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="a2a_wire_"))
            out_dir.mkdir(parents=True, exist_ok=True)
            payload = run_on_cluster(args, out_dir)
            payload["out_dir"] = str(out_dir)
        payload = analyse(payload, args)
    except (ValueError, RuntimeError, subprocess.TimeoutExpired, Terminated) as err:
        return output.fail(str(err))[0]
    payload["command"] = "python tools/a2a_wire.py " + " ".join(argv or sys.argv[1:])
    payload["wall_s"] = round(time.time() - started, 1)
    if args.markdown or args.plot:
        from megatron_mvmoe.analysis.a2a.wire_page import write_page, write_plot

        if args.plot:
            payload["plot"] = write_plot(payload, args.plot)
        if args.markdown:
            payload["markdown"] = write_page(payload, args.markdown)
    output.emit(payload, args.json, text_summary(payload))
    return 0 if payload["all_within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
