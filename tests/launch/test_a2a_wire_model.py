"""The wire model of tools/a2a_wire.py against naive references (no cluster needed):
collectives -> bytes per node link, header / control subtraction, /proc/net/dev parsing,
and the shaped-link time model and its fit."""

import random

import pytest
import torch

from megatron_mvmoe.analysis.a2a.link_time import WireLink, collective_wire_time_s, fit_wire_link
from megatron_mvmoe.analysis.a2a.wire import (HEADER_BYTES, WireRecord, measured_payload,
                                          minimal_replay_sizes, node_link_bytes, rank_matrix,
                                          received_split)
from megatron_mvmoe.analysis.a2a.wire_report import receive_bandwidth
from megatron_mvmoe.dev_cluster import Cluster
from megatron_mvmoe.dev_cluster.netns import Layout, parse_proc_net_dev


def _naive_link_bytes(records_by_rank, node_of):
    """Loop over every send of every rank: all-to-all direct, all-gather as gloo's ring."""
    out = {n: {"tx": 0, "rx": 0} for n in set(node_of)}
    for src, records in enumerate(records_by_rank):
        for r in records:
            group = list(r.group_ranks)
            if r.op == "all_to_all_single":
                sends = list(zip(group, r.peer_bytes))
            else:
                right = group[(group.index(src) + 1) % len(group)]
                sends = [(right, r.input_bytes)] * (len(group) - 1)
            for dst, b in sends:
                if node_of[src] != node_of[dst]:
                    out[node_of[src]]["tx"] += b
                    out[node_of[dst]]["rx"] += b
    return out


@pytest.mark.parametrize("world,per_node", [(2, 1), (4, 2), (4, 1)])
def test_node_link_bytes_equal_a_naive_loop(world, per_node):
    rng = random.Random(world * 10 + per_node)
    group = tuple(range(world))
    records = [[WireRecord("all_to_all_single", 0, tuple(rng.randrange(0, 999) * 4
                                                         for _ in group), group),
                WireRecord("all_gather_into_tensor", 8 * rng.randrange(1, 9), (), group,
                           "metadata")] for _ in range(world)]
    node_of = [r // per_node for r in range(world)]
    assert node_link_bytes(rank_matrix(records, world), node_of) == _naive_link_bytes(
        records, node_of)


def test_receive_side_split_and_bandwidth_as_hybridep_reports_it():
    """Each rank's received bytes from other ranks, intra / inter-node (own bytes excluded),
    and the busiest receiver's GB/s over the measured time."""
    m = torch.arange(16).reshape(4, 4) * 1000  # rank s sends m[s, q] to rank q
    split = received_split(m, [0, 0, 1, 1])
    for q in range(4):
        same = [s for s in range(4) if s // 2 == q // 2 and s != q]
        assert split["intra"][q] == sum(int(m[s, q]) for s in same)
        assert split["inter"][q] == sum(int(m[s, q]) for s in range(4) if s // 2 != q // 2)
    samples = [{"received": split, "seconds": 1e-3}, {"received": split, "seconds": 2e-3}]
    got = receive_bandwidth(samples)
    assert got["recv_inter_GBps_median"] == pytest.approx(  # median of 1/1 ms and 1/2 ms
        max(split["inter"]) * (1e3 + 0.5e3) / 2 / 1e9)
    assert receive_bandwidth([{"seconds": 1.0}]) == {}


def test_payload_subtracts_66_bytes_per_frame_and_the_replayed_control():
    window = {"tx_bytes": 10_000 + 3 * HEADER_BYTES + 96, "tx_packets": 3,
              "rx_bytes": 2 * HEADER_BYTES + 48, "rx_packets": 2}
    replay = {"tx_bytes": 1 * HEADER_BYTES + 96 + 8, "tx_packets": 1,
              "rx_bytes": HEADER_BYTES + 48, "rx_packets": 1}
    out = measured_payload(window, replay, {"tx": 8, "rx": 0})
    assert out["tx"]["payload"] == 10_000 and out["tx"]["control"] == 96
    assert out["rx"]["payload"] == 0 and out["rx"]["headers"] == 2 * HEADER_BYTES


def test_minimal_replay_keeps_the_calls_and_drops_the_bytes():
    group = (0, 1)
    mini = minimal_replay_sizes([WireRecord("all_to_all_single", 64, (32, 32), group),
                                 WireRecord("all_gather_into_tensor", 64, (), group,
                                            dtype="int64")])
    assert mini[0].peer_bytes == (0, 0) and mini[1].input_bytes == 8


def test_proc_net_dev_parsing_and_cluster_names():
    text = ("Inter-|   Receive |  Transmit\n face |bytes packets ...\n"
            "  mvw71: 100 2 0 0 0 0 0 0 300 4 0 0 0 0 0 0\n")
    assert parse_proc_net_dev(text)["mvw71"] == {"rx_bytes": 100, "rx_packets": 2,
                                                  "tx_bytes": 300, "tx_packets": 4}
    a, b = Cluster(4, 7).layout, Cluster(2, 8).layout
    assert not set(a.all_netns()) & set(b.all_netns()) and a.subnet != b.subnet
    assert a.ctld_port != b.ctld_port and Cluster(2, 0).layout.netns("n2") == "mvmoe_n2"
    assert Cluster(2, 3).state != Cluster(2, 0).state != Cluster(1).state
    for bad, field in (((5, 1), "--nodes"), ((0, 0), "--nodes"), ((1, 2), "--instance")):
        with pytest.raises(ValueError, match=field):
            Cluster(*bad)
    with pytest.raises(ValueError, match="--nodes"):
        Layout(1, 0)
    with pytest.raises(ValueError, match="one-node cluster has no namespaces"):
        Cluster(1).layout


def test_time_model_and_fit_recover_known_parameters():
    truth = WireLink(1e9, efficiency=0.8, per_message_s=50e-6)
    samples = []
    for rate in (2e8, 1e9, 5e9):
        link = WireLink(rate, truth.efficiency, per_message_s=truth.per_message_s)
        for size in (10_000, 100_000, 1_000_000):
            colls = [(size, 1), (size // 2, 1)]
            seconds = sum(collective_wire_time_s({0: {"tx": b, "rx": b // 3}}, m, link)
                          for b, m in colls)
            samples.append({"rate_bps": rate, "seconds": seconds, "collectives": colls})
    efficiency, per_message = fit_wire_link(samples)
    assert efficiency == pytest.approx(0.8, rel=1e-9)
    assert per_message == pytest.approx(50e-6, rel=1e-9)
    assert collective_wire_time_s({0: {"tx": 1000, "rx": 0}}, 0, WireLink(8000)) == 1.0
    with pytest.raises(ValueError, match="rate_bps"):
        WireLink(0)
