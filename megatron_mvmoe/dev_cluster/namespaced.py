"""The namespaced N-node cluster's life cycle (N = 2..4; names, network and files in
netns.py): start (namespaces, munged, slurmctld, one slurmd per node), status, stop (jobs,
daemons, leftovers, namespaces), a client command in n1's namespace, and the reaper that stops
the cluster once the process that started it is gone."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

from megatron_mvmoe.dev_cluster import netns as ns
from megatron_mvmoe.dev_cluster.processes import (DevClusterError, kill, node_resources,
                                                  proc_state, read_record, record_path,
                                                  require_tools, runs, spawn, write_record)


def _program(name: str) -> str:
    return name.split("_")[0]


def _daemons(c: ns.Layout) -> tuple:
    return ("munged", "slurmctld", *(f"slurmd_{n}" for n in c.names))


def status(c: ns.Layout, state_dir: Path) -> Dict[str, object]:
    record = read_record(state_dir)
    pids = {k: v for k, v in record.items() if k in _daemons(c)}
    alive = {name: runs(pid, _program(name)) for name, pid in pids.items() if pid}
    nodes = ns.node_states(c, state_dir) if alive.get("slurmctld") else None
    counters = ns.read_counters(c)
    running = (len(alive) == len(_daemons(c)) and all(alive.values()) and nodes is not None
               and all(nodes.get(n) in ("idle", "mixed", "allocated") for n in c.names))
    return {"running": running, "nodes": c.nodes, "instance": c.instance,
            "state_dir": str(state_dir), "slurm_conf": str(ns.paths(state_dir)["conf"]),
            "pids": pids, "alive": alive, "node_states": nodes, "netns": ns.namespaces_exist(c),
            "addresses": {n: c.address(n) for n in c.names}, "partition": c.partition,
            "links": {n: c.veth(n) for n in c.names}, "netns_of": {
                n: c.netns(n) for n in c.names},
            "veth": {dev: {k: v for k, v in counts.items() if k.endswith("_bytes")}
                     for dev, counts in counters.items()},  # bytes only, as before N nodes
            "link_counters": counters, "client_prefix": c.client_prefix(),
            "env": {"SLURM_CONF": str(ns.paths(state_dir)["conf"])}}


def stop(c: ns.Layout, state_dir: Path) -> Dict[str, object]:
    """Cancel jobs, kill the recorded daemons (reverse order), kill what is left inside the
    namespaces, then delete namespaces, veths (and their tc rules) and mounts."""
    record = read_record(state_dir)
    if record.get("slurmctld") and runs(record["slurmctld"], "slurmctld"):
        ns.cancel_jobs(c, state_dir)
    for name in reversed(_daemons(c)):
        if record.get(name):
            kill(record[name], _program(name))
    widest = ns.Layout(ns.MAX_NODES, c.instance)  # also nodes of a bigger earlier start
    leftovers = ns.kill_namespace_processes(widest)
    ns.delete_network(widest, bool(record.get("run_netns_was_mounted", True)))
    record_path(state_dir).unlink(missing_ok=True)
    return {**status(c, state_dir), "killed_in_namespaces": leftovers,
            "stopped": {k: v for k, v in record.items() if k in _daemons(c) and v}}


def start(c: ns.Layout, state_dir: Path, timeout_s: float = 60.0) -> Dict[str, object]:
    """Namespaces + bridge, munged, slurmctld and slurmd n1 in n1, slurmd nJ in nJ; waits
    until every node is idle."""
    require_tools()
    current = status(c, state_dir)
    if current["running"]:
        return {**current, "already_running": True}
    stop(c, state_dir)
    if any(ns.namespaces_exist(c).values()):
        raise DevClusterError(f"network namespaces {ns.namespaces_exist(c)} exist but no "
                              f"daemons are recorded in {state_dir}: remove them with "
                              f"`ip netns del {' '.join(c.all_netns())}` (another state dir?)")
    logs = ns.paths(state_dir)["logs"]
    ns.write_files(c, state_dir, node_resources())
    record: Dict[str, object] = {"nodes": c.nodes, "instance": c.instance}
    try:
        record["run_netns_was_mounted"] = ns.create_network(c)
        write_record(state_dir, record)
        record["munged"] = spawn(ns.munged_cmd(state_dir), logs / "munged.out")
        write_record(state_dir, record)
        if not ns.wait_for(lambda: ns.munge_answers(state_dir), 20):
            raise DevClusterError(f"munged did not answer; see {logs / 'munged.out'}")
        record["slurmctld"] = spawn(ns.slurmctld_cmd(c, state_dir), logs / "slurmctld.out")
        write_record(state_dir, record)
        for node in c.names:
            record[f"slurmd_{node}"] = spawn(ns.slurmd_cmd(c, state_dir, node),
                                              logs / f"slurmd_{node}.out")
            write_record(state_dir, record)
        if not ns.wait_for(lambda: status(c, state_dir)["running"], timeout_s):
            raise DevClusterError(f"timed out after {timeout_s:.0f} s waiting for nodes "
                                  f"{c.names} to be idle; see {logs}")
    except BaseException:
        stop(c, state_dir)
        raise
    return {**status(c, state_dir), "already_running": False}


def exec_command(c: ns.Layout, command: List[str], state_dir: Path) -> int:
    """Run a Slurm client command in n1's network namespace with SLURM_CONF set."""
    return subprocess.run([*c.client_prefix(), *command],
                          env=ns.client_env(state_dir)).returncode


def reap(c: ns.Layout, state_dir: Path, pid: int, poll_s: float = 0.5) -> Dict[str, object]:
    """Wait until process `pid` is gone (however it ended, SIGKILL included), then stop the
    cluster: a tool that starts a cluster spawns this so nothing outlives it."""
    while proc_state(pid) not in (None, "Z", "X"):
        time.sleep(poll_s)
    return stop(c, state_dir)


def spawn_reaper(c: ns.Layout, state_dir: Path, pid: int) -> int:
    """Start `reap` detached (own session: a signal to the caller's group spares it)."""
    log = state_dir / "reaper.out"
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "megatron_mvmoe.dev_cluster", "reap", "--pid", str(pid),
             "--nodes", str(c.nodes), "--instance", str(c.instance), "--state-dir",
             str(state_dir), "--json"], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            start_new_session=True)
    return proc.pid
