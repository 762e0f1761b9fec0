"""On a real 2-node Slurm cluster of network namespaces (tools/a2a_wire.py starts its own,
instance 7 / 8, so it cannot clash with test_two_node_slurm's or another helper's):

- the inter-node payload read from the interface counters equals the analytic prediction
  within the tool's tolerance, for Megatron's rows and the dedup dispatcher (views mode too);
- a run killed half-way (SIGKILL and SIGTERM, while tc rules are on the links) leaves no
  namespace, link, tc rule, daemon or job process behind.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.launchers, pytest.mark.slow, pytest.mark.timeout(300)]
NEEDS = ("slurmctld", "slurmd", "munged", "nsenter", "ip", "tc")


@pytest.fixture(autouse=True)
def _root_and_slurm():
    if os.geteuid() != 0 or not all(shutil.which(t) for t in NEEDS):
        pytest.skip("the namespaced cluster needs root, slurm-wlm, munge, iproute2")


def _tool(*args, **popen):
    cmd = [sys.executable, "tools/a2a_wire.py", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=env, **popen)


def test_two_node_payload_on_the_wire_equals_the_prediction(tmp_path):
    out = _tool("--layouts", "2x1", "--variants", "latent", "multi_view", "--semantics",
                "row", "rank", "--repeats", "3", "--instance", "7", "--out-dir",
                str(tmp_path), "--json")
    assert out.returncode == 0, out.stderr[-3000:]
    payload = json.loads(out.stdout)
    cases = payload["cases"]
    assert len(cases) == 5 and payload["all_within_tolerance"]
    assert payload["tolerance"] <= 0.02
    for case in cases:
        assert case["analytic_equals_counted"] and case["outside_dispatchers"] == 0
        assert case["max_abs_error"] <= payload["tolerance"], case["summary"]
        for s in case["summary"].values():  # something crossed, and its overhead is stated
            assert s["predicted"] > 10_000 and s["headers"] > 0 and s["control"] > 0
    views = [c for c in cases if c["case"].get("views_case")]
    assert views and views[0]["views_mode_pairs"] > 0 and views[0]["max_experts_on_one_rank"] >= 3
    assert payload["cluster"]["left_after_stop"] == {"namespaces": [], "daemons": []}


def _leftovers(instance: int) -> dict:
    prefix = f"mvw{instance}"
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    state = Path(f"/tmp/mvmoe_slurm_i{instance}") / "daemons.json"
    return {"netns": [n for n in netns.split() if n.startswith(prefix + "_")],
            "links": [line for line in links.splitlines() if f" {prefix}" in line],
            "daemons_recorded": state.exists()}


def _tbf_on(instance: int) -> bool:
    out = subprocess.run(["ip", "netns", "exec", f"mvw{instance}_n1", "tc", "qdisc", "show",
                          "dev", f"mvw{instance}1"], capture_output=True, text=True)
    return "tbf" in out.stdout


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_run_killed_half_way_leaves_nothing(tmp_path, sig):
    instance = 8
    assert not any(_leftovers(instance).values()), "leftovers before the test"
    cmd = [sys.executable, "tools/a2a_wire.py", "--skip-bytes", "--time", "--time-cases",
           "latent:row",
           "--rates-mbit", "50", "--fit-rates-mbit", "50", "--time-repeats", "200",
           "--time-batch-size", "2", "--time-seq-length", "64", "--instance", str(instance),
           "--out-dir", str(tmp_path), "--json"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 150
    while not _tbf_on(instance):  # half-way = shaped links and a job running on them
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "the run never shaped its links"
        time.sleep(0.2)
    proc.send_signal(sig)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60  # SIGKILL: the reaper stops the cluster
    while any(_leftovers(instance).values()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_leftovers(instance).values()), _leftovers(instance)
    assert proc.returncode != 0
    assert not _workers_of(tmp_path), "worker processes left behind"


def _workers_of(out_dir: Path) -> list:
    """PIDs whose command line names this run's spec files."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if proc.name.isdigit() and "wire_worker" in cmd and str(out_dir) in cmd:
            found.append(int(proc.name))
    return found
