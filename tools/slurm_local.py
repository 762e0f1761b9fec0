"""Start, stop or inspect a one-node Slurm cluster on localhost (root, no systemd).

    python tools/slurm_local.py start [--json]    # munged, slurmctld, slurmd; waits for 'idle'
    export SLURM_CONF=/tmp/mvmoe_slurm/slurm.conf  # printed by start; sbatch/srun/sinfo need it
    python tools/slurm_local.py status [--json]
    python tools/slurm_local.py stop [--json]     # kills only the daemons start recorded
    python tools/slurm_local.py start --nodes 2    # two nodes n1, n2 in network namespaces
    python tools/slurm_local.py exec -- sbatch ... # a client command in n1's namespace
    python tools/slurm_local.py stop --nodes 2     # daemons by PID, namespaces, veth, mounts
    python tools/slurm_local.py start --nodes 4 --instance 3  # 4 nodes, names mvw3_*
    python tools/slurm_local.py reap --pid P --nodes 4 --instance 3  # stop it once P is gone

Design choices (see docs/ENVIRONMENT.md, "MPI and Slurm"):
- Every file lives in one state dir (default /tmp/mvmoe_slurm): slurm.conf, spool,
  state, logs and `daemons.json`, the PIDs this tool started. `stop` signals exactly
  those PIDs (after checking each still runs the program it started), never by name.
- Idempotent: `start` on a healthy cluster reports it and starts nothing; a
  half-dead one is stopped and started again. `stop` with nothing running is a no-op.
  A munged someone else started (its socket answers) is reused and left alone.
- The node is this host: NodeName = hostname, NodeAddr = 127.0.0.1, CPUs/RealMemory
  from `slurmd -C`; proctrack/linuxproc and task/none need no cgroups; accounting off;
  select/cons_tres with CR_CPU so jobs need not request memory.
- Daemons run in the foreground (-D / -F) in their own session, so the PID recorded
  is the daemon's own, and they outlive this command.
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

DEFAULT_STATE_DIR = Path(os.environ.get("MVMOE_SLURM_STATE", "/tmp/mvmoe_slurm"))
DAEMONS = ("munged", "slurmctld", "slurmd")
"""Start order; stop goes in reverse."""
MUNGE_DIRS = ("/run/munge", "/var/lib/munge", "/var/log/munge")
PARTITION = "local"


class SlurmLocalError(RuntimeError):
    """A step of start/stop failed; the message says which and where the log is."""


# ---------------------------------------------------------------- processes by PID
def _proc_state(pid: int) -> Optional[str]:
    """Single-letter state from /proc/<pid>/stat, or None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _runs(pid: Optional[int], program: str) -> bool:
    """True if pid is alive (not a zombie) and still runs `program` (PIDs get reused)."""
    if not pid or _proc_state(pid) in (None, "Z", "X"):
        return False
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    return comm == program[:15]


def _kill(pid: int, program: str, grace_s: float = 10.0) -> None:
    """SIGTERM, wait up to grace_s, then SIGKILL; only if pid still runs program."""
    if not _runs(pid, program):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _runs(pid, program):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def _spawn(cmd: List[str], log: Path, user: Optional[str] = None) -> int:
    """Start a foreground daemon detached from this process; return its PID."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                start_new_session=True, user=user)
    return proc.pid


# ---------------------------------------------------------------- state dir
def _paths(state_dir: Path) -> Dict[str, Path]:
    return {"conf": state_dir / "slurm.conf", "daemons": state_dir / "daemons.json",
            "ctld": state_dir / "ctld", "spool": state_dir / "spool", "logs": state_dir / "logs"}


def _read_pids(state_dir: Path) -> Dict[str, Optional[int]]:
    try:
        return json.loads(_paths(state_dir)["daemons"].read_text())
    except (OSError, ValueError):
        return {}


def _write_pids(state_dir: Path, pids: Dict[str, Optional[int]]) -> None:
    _paths(state_dir)["daemons"].write_text(json.dumps(pids))


def _client_env(state_dir: Path) -> Dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(_paths(state_dir)["conf"])}


# ---------------------------------------------------------------- munge
def _munge_answers() -> bool:
    """A munged serves the default socket: encode and decode one credential."""
    if not shutil.which("munge") or not shutil.which("unmunge"):
        return False
    cred = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    if cred.returncode != 0:
        return False
    return subprocess.run(["unmunge"], input=cred.stdout, capture_output=True, timeout=10).returncode == 0


def _start_munge(logs: Path) -> Optional[int]:
    """Reuse a running munged, else start one as user munge. Returns our PID or None."""
    if _munge_answers():
        return None
    if not Path("/etc/munge/munge.key").exists():
        raise SlurmLocalError("/etc/munge/munge.key is missing: run `mungekey --create` as root "
                              "(Debian's munge package creates it on install)")
    munge = pwd.getpwnam("munge")
    for d in MUNGE_DIRS:
        os.makedirs(d, exist_ok=True)
        os.chown(d, munge.pw_uid, munge.pw_gid)
        os.chmod(d, 0o755 if d == "/run/munge" else 0o700)
    pid = _spawn(["munged", "--foreground"], logs / "munged.out", user="munge")
    _wait(_munge_answers, 20.0, "munged to answer on /run/munge/munge.socket.2",
          "/var/log/munge/munged.log")
    return pid


# ---------------------------------------------------------------- slurm
def _node_resources() -> Dict[str, str]:
    """CPUs and RealMemory as `slurmd -C` reports them for this host."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=30, check=True).stdout
    fields = dict(item.split("=", 1) for item in out.split() if "=" in item)
    return {"CPUs": fields["CPUs"], "RealMemory": fields["RealMemory"]}


def _slurm_conf(state_dir: Path, host: str) -> str:
    p, res = _paths(state_dir), _node_resources()
    return "\n".join([
        "ClusterName=mvmoe-local",
        f"SlurmctldHost={host}(127.0.0.1)",
        "SlurmUser=root", "SlurmdUser=root",
        "AuthType=auth/munge", "CredType=cred/munge",
        f"StateSaveLocation={p['ctld']}", f"SlurmdSpoolDir={p['spool']}",
        f"SlurmctldPidFile={state_dir / 'slurmctld.pid'}", f"SlurmdPidFile={state_dir / 'slurmd.pid'}",
        f"SlurmctldLogFile={p['logs'] / 'slurmctld.log'}", f"SlurmdLogFile={p['logs'] / 'slurmd.log'}",
        "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "AccountingStorageType=accounting_storage/none", "JobAcctGatherType=jobacct_gather/none",
        "JobCompType=jobcomp/none", "MpiDefault=none", "SwitchType=switch/none",
        "ReturnToService=2", "SchedulerType=sched/backfill", "MailProg=/bin/true",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={res['CPUs']} RealMemory={res['RealMemory']} State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


def _node_state(state_dir: Path) -> Optional[str]:
    """The node's state as sinfo reports it ('idle', 'mixed', ...), or None if unreachable."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True,
                             timeout=10, env=_client_env(state_dir))
    except subprocess.TimeoutExpired:
        return None
    return out.stdout.strip().lower() or None if out.returncode == 0 else None


def _wait(ready, timeout_s: float, what: str, log: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return
        time.sleep(0.25)
    raise SlurmLocalError(f"timed out after {timeout_s:.0f} s waiting for {what}; see {log}")


def _require_tools() -> None:
    missing = [t for t in ("munged", "slurmctld", "slurmd", "sinfo") if not shutil.which(t)]
    if missing:
        raise SlurmLocalError(f"not installed: {', '.join(missing)}. Fix: apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        raise SlurmLocalError("must run as root (the daemons run as root and munged as user munge)")


# ---------------------------------------------------------------- commands
def status(state_dir: Path = DEFAULT_STATE_DIR) -> Dict[str, object]:
    pids = _read_pids(state_dir)
    alive = {name: _runs(pid, name) for name, pid in pids.items() if pid}
    # sinfo blocks for its message timeout (~10 s) when no slurmctld listens: ask only ours
    node_state = _node_state(state_dir) if alive.get("slurmctld") else None
    running = bool(pids) and all(alive.values()) and node_state is not None
    return {"running": running, "state_dir": str(state_dir), "slurm_conf": str(_paths(state_dir)["conf"]),
            "pids": pids, "alive": alive, "node": socket.gethostname(), "node_state": node_state,
            "partition": PARTITION, "env": {"SLURM_CONF": str(_paths(state_dir)["conf"])}}


def stop(state_dir: Path = DEFAULT_STATE_DIR) -> Dict[str, object]:
    """Kill the daemons `start` recorded, in reverse start order."""
    pids = _read_pids(state_dir)
    for name in reversed(DAEMONS):
        if pids.get(name):
            _kill(pids[name], name)
    _paths(state_dir)["daemons"].unlink(missing_ok=True)
    return {**status(state_dir), "stopped": {k: v for k, v in pids.items() if v}}


def start(state_dir: Path = DEFAULT_STATE_DIR, timeout_s: float = 60.0) -> Dict[str, object]:
    """Bring the cluster up (or report the one already up) and wait until the node is idle."""
    _require_tools()
    current = status(state_dir)
    if current["running"]:
        return {**current, "already_running": True}
    stop(state_dir)  # a half-dead cluster from an earlier run
    p, host = _paths(state_dir), socket.gethostname()
    for d in (p["ctld"], p["spool"], p["logs"]):
        d.mkdir(parents=True, exist_ok=True)
    p["conf"].write_text(_slurm_conf(state_dir, host))
    pids: Dict[str, Optional[int]] = {}
    try:
        pids["munged"] = _start_munge(p["logs"])
        _write_pids(state_dir, pids)
        pids["slurmctld"] = _spawn(["slurmctld", "-D", "-c", "-f", str(p["conf"])], p["logs"] / "slurmctld.out")
        _write_pids(state_dir, pids)
        pids["slurmd"] = _spawn(["slurmd", "-D", "-f", str(p["conf"])], p["logs"] / "slurmd.out")
        _write_pids(state_dir, pids)
        _wait(lambda: _node_state(state_dir) == "idle", timeout_s,
              f"node {host} to be idle in sinfo", str(p["logs"]))
    except BaseException:
        stop(state_dir)
        raise
    return {**status(state_dir), "already_running": False}


# ---------------------------------------------------------------- N nodes (slurm_netns.py)
def _program(name: str) -> str:
    return name.split("_")[0]


def _daemons_n(c) -> tuple:
    return ("munged", "slurmctld", *(f"slurmd_{n}" for n in c.names))


def status_n(c, state_dir: Path) -> Dict[str, object]:
    import slurm_netns as ns

    record = _read_pids(state_dir)
    pids = {k: v for k, v in record.items() if k in _daemons_n(c)}
    alive = {name: _runs(pid, _program(name)) for name, pid in pids.items() if pid}
    nodes = ns.node_states(c, state_dir) if alive.get("slurmctld") else None
    counters = ns.read_counters(c)
    running = (len(alive) == len(_daemons_n(c)) and all(alive.values()) and nodes is not None
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


def stop_n(c, state_dir: Path) -> Dict[str, object]:
    """Cancel jobs, kill the recorded daemons (reverse order), kill what is left inside the
    namespaces, then delete namespaces, veths (and their tc rules) and mounts."""
    import slurm_netns as ns

    record = _read_pids(state_dir)
    if record.get("slurmctld") and _runs(record["slurmctld"], "slurmctld"):
        ns.cancel_jobs(c, state_dir)
    for name in reversed(_daemons_n(c)):
        if record.get(name):
            _kill(record[name], _program(name))
    widest = ns.Cluster(ns.MAX_NODES, c.instance)  # also nodes of a bigger earlier start
    leftovers = ns.kill_namespace_processes(widest)
    ns.delete_network(widest, bool(record.get("run_netns_was_mounted", True)))
    _paths(state_dir)["daemons"].unlink(missing_ok=True)
    return {**status_n(c, state_dir), "killed_in_namespaces": leftovers,
            "stopped": {k: v for k, v in record.items() if k in _daemons_n(c) and v}}


def start_n(c, state_dir: Path, timeout_s: float = 60.0) -> Dict[str, object]:
    """Namespaces + bridge, munged, slurmctld and slurmd n1 in n1, slurmd nJ in nJ; waits
    until every node is idle."""
    import slurm_netns as ns

    _require_tools()
    current = status_n(c, state_dir)
    if current["running"]:
        return {**current, "already_running": True}
    stop_n(c, state_dir)
    if any(ns.namespaces_exist(c).values()):
        raise SlurmLocalError(f"network namespaces {ns.namespaces_exist(c)} exist but no "
                              f"daemons are recorded in {state_dir}: remove them with "
                              f"`ip netns del {' '.join(c.all_netns())}` (another state dir?)")
    logs = ns.paths(state_dir)["logs"]
    ns.write_files(c, state_dir, _node_resources())
    record: Dict[str, object] = {"nodes": c.nodes, "instance": c.instance}
    try:
        record["run_netns_was_mounted"] = ns.create_network(c)
        _write_pids(state_dir, record)
        record["munged"] = _spawn(ns.munged_cmd(state_dir), logs / "munged.out")
        _write_pids(state_dir, record)
        if not ns.wait_for(lambda: ns.munge_answers(state_dir), 20):
            raise SlurmLocalError(f"munged did not answer; see {logs / 'munged.out'}")
        record["slurmctld"] = _spawn(ns.slurmctld_cmd(c, state_dir), logs / "slurmctld.out")
        _write_pids(state_dir, record)
        for node in c.names:
            record[f"slurmd_{node}"] = _spawn(ns.slurmd_cmd(c, state_dir, node),
                                              logs / f"slurmd_{node}.out")
            _write_pids(state_dir, record)
        if not ns.wait_for(lambda: status_n(c, state_dir)["running"], timeout_s):
            raise SlurmLocalError(f"timed out after {timeout_s:.0f} s waiting for nodes "
                                  f"{c.names} to be idle; see {logs}")
    except BaseException:
        stop_n(c, state_dir)
        raise
    return {**status_n(c, state_dir), "already_running": False}


def exec_n(c, command: List[str], state_dir: Path) -> int:
    """Run a Slurm client command in n1's network namespace with SLURM_CONF set."""
    import slurm_netns as ns

    return subprocess.run([*c.client_prefix(), *command],
                          env=ns.client_env(state_dir)).returncode


def reap(c, state_dir: Path, pid: int, poll_s: float = 0.5) -> Dict[str, object]:
    """Wait until process `pid` is gone (however it ended, SIGKILL included), then stop the
    cluster: a tool that starts a cluster spawns this so nothing outlives it."""
    while _proc_state(pid) not in (None, "Z", "X"):
        time.sleep(poll_s)
    return stop_n(c, state_dir)


def spawn_reaper(c, state_dir: Path, pid: int) -> int:
    """Start `reap` detached (own session: a signal to the caller's group spares it)."""
    log = state_dir / "reaper.out"
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "reap", "--pid", str(pid),
             "--nodes", str(c.nodes), "--instance", str(c.instance), "--state-dir",
             str(state_dir), "--json"], stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            start_new_session=True)
    return proc.pid


def _cluster(args):
    import slurm_netns as ns

    state = (args.state_dir or ns.default_state_dir(args.instance)).resolve()
    recorded = _read_pids(state).get("nodes")
    nodes = recorded if recorded and args.command != "start" else max(args.nodes, 2)
    return ns.Cluster(nodes, args.instance), state


def _dispatch(args) -> Dict[str, object]:
    if args.nodes >= 2 or args.instance or args.command == "reap":
        c, state = _cluster(args)
        return {"start": lambda: start_n(c, state, args.timeout_s),
                "stop": lambda: stop_n(c, state), "status": lambda: status_n(c, state),
                "reap": lambda: reap(c, state, args.pid)}[args.command]()
    state = (args.state_dir or DEFAULT_STATE_DIR).resolve()
    if args.command == "start":
        return start(state, args.timeout_s)
    return (stop if args.command == "stop" else status)(state)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(
        description="Local Slurm cluster: one node on localhost, or (--nodes 2..4) nodes in "
        "network namespaces on a bridge. `exec -- CMD...` runs a Slurm client "
        "command (sbatch, srun, scontrol) where the 2-node cluster's controller is reachable.")
    parser.add_argument("command", choices=["start", "stop", "status", "exec", "reap"])
    parser.add_argument("rest", nargs="*", help="exec: the command to run (after --)")
    parser.add_argument("--nodes", type=int, choices=[1, 2, 3, 4], default=1,
                        help="1: one-node cluster on localhost; 2..4: namespaced nodes on a "
                        "bridge")
    parser.add_argument("--instance", type=int, default=0,
                        help="namespaced clusters: 0 = mvmoe_nJ, 10.77.12.J; I > 0 = its own "
                        "names (mvwI_nJ), subnet 10.77.(12+I), ports and state dir")
    parser.add_argument("--pid", type=int, default=None, help="reap: the process to outlive")
    parser.add_argument("--state-dir", type=Path, default=None,
                        help="where slurm.conf, logs, state and recorded PIDs live (default "
                        f"{DEFAULT_STATE_DIR}, /tmp/mvmoe_slurm2 with --nodes >= 2, "
                        "/tmp/mvmoe_slurm_iI with --instance I)")
    parser.add_argument("--timeout-s", type=float, default=60.0, help="start: wait this long for 'idle'")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.rest = rest or args.rest
    if args.command == "exec":
        cluster, state = _cluster(args)
        return exec_n(cluster, args.rest, state)
    if args.command == "reap" and not args.pid:
        parser.error("reap: --pid is required")
    try:
        result = _dispatch(args)
    except (SlurmLocalError, subprocess.SubprocessError, OSError, ValueError) as err:
        if args.json:
            print(json.dumps({"error": str(err), "command": args.command}))
        else:
            print(f"slurm_local {args.command}: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        state = result.get("node_states") or result.get("node_state")
        print(f"running={result['running']} nodes={result.get('nodes', 1)} state={state} "
              f"pids={result['pids']}")
        if result["running"]:
            print(f"export SLURM_CONF={result['slurm_conf']}")
            if result.get("client_prefix"):
                print(f"clients: {' '.join(result['client_prefix'])} sbatch ...")
    return 0 if args.command in ("stop", "status", "reap") or result["running"] else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
