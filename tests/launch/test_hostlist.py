"""Slurm hostlist / tasks-per-node expansion against hand-written cases and, where the
Slurm client is installed, against `scontrol show hostnames` itself."""

import os
import shutil
import subprocess

import pytest

from megatron_mvmoe.launch.hostlist import expand_hostlist, expand_tasks_per_node

CASES = [
    ("vm", ["vm"]),
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),
    ("a[1-2]-b[01-02]", ["a1-b01", "a1-b02", "a2-b01", "a2-b02"]),
    ("x[007]", ["x007"]),
    ("gpu-[1,3],cpu[2-3].ib", ["gpu-1", "gpu-3", "cpu2.ib", "cpu3.ib"]),
    ("h1, h2", ["h1", "h2"]),
]


@pytest.mark.parametrize("text,hosts", CASES)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["", "node[01-03", "node]1[", "n[3-1]", "n[a-b]", "n[[1]]"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        expand_hostlist(bad)


# Slurm 22.05 rejects a suffix after brackets ("cpu[2-3].ib"); newer releases accept it.
SCONTROL_CASES = [c[0] for c in CASES if " " not in c[0] and ".ib" not in c[0]]


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol (slurm-wlm) not installed")
@pytest.mark.parametrize("text", SCONTROL_CASES)
def test_expand_hostlist_matches_scontrol(text, tmp_path):
    # scontrol refuses to run without a config source, even for pure expansion
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=hostlist\nSlurmctldHost=localhost\n")
    out = subprocess.run(
        ["scontrol", "show", "hostnames", text], capture_output=True, text=True, timeout=20,
        check=True, env={"SLURM_CONF": str(conf), "PATH": os.environ["PATH"]},
    ).stdout.split()
    assert expand_hostlist(text) == out


@pytest.mark.parametrize(
    "text,counts",
    [("2", [2]), ("2(x3),1", [2, 2, 2, 1]), ("4(x2)", [4, 4]), ("1,3", [1, 3])],
)
def test_expand_tasks_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("bad", ["", "2(3)", "x2", "2(x)"])
def test_expand_tasks_per_node_rejects_malformed(bad):
    with pytest.raises(ValueError):
        expand_tasks_per_node(bad)
