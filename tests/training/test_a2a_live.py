"""Live all-to-all metrics of a training run (training/a2a_metrics.py) equal the bytes
counted at torch.distributed for the same steps, per rank and MoE layer, bookkeeping
included: EP = 2 with the dedup_node dispatcher (two hops, one rank per node), and the
TP x EP and PP x EP layouts with Megatron's alltoall rows. Also in metrics.jsonl,
TensorBoard, the console summary and tools/plot_a2a_metrics.py."""

import copy
import glob
import json
import os

import pytest
import torch.distributed as dist

from harness import tiny_run
from megatron_mvmoe.config.run_config import config_from_dict
from megatron_mvmoe.testing.spawn import run_distributed

STEPS = 2


def _phase_group(phase):
    return "combine" if phase == "token_combine" else "dispatch"


def _counted_rank(rank, world_size, raw):
    """Train under the collective counter; this rank's bytes sent to each EP peer per
    (layer number, dispatch | combine, fwd | bwd), and its EP group."""
    from megatron_mvmoe.analysis.a2a.counter import count_collectives
    from megatron_mvmoe.analysis.a2a.volume import peer_counts
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.training.pretrain import pretrain

    run = config_from_dict(copy.deepcopy(raw))
    pgs = initialize_layout(run.parallel.layout(), timeout_s=60)
    with count_collectives(None) as counter:
        names = {}

        def on_step(step, trainer):  # name each dispatcher by its layer number
            for chunk in trainer.unwrapped():
                for module in chunk.modules():
                    if hasattr(module, "token_dispatcher") and hasattr(module, "layer_number"):
                        names[id(module.token_dispatcher)] = int(module.layer_number)
            counter._names.update({k: str(v) for k, v in names.items()})
        pretrain(run, pgs, on_step=on_step)
    sent = {}
    for layer, keys in peer_counts(counter.records).items():
        for (phase, direction, _), peers in keys.items():
            key = (int(layer), _phase_group(phase), direction)
            sent[key] = [a + b for a, b in zip(sent.get(key, [0] * len(peers)), peers)]
    return {"sent": sent, "ep_ranks": dist.get_process_group_ranks(pgs.ep)}


def _train(tmp_path, text_tokens, parallel, world, **model):
    raw = tiny_run(text_tokens, parallel=parallel, train_iters=STEPS, eval_iters=0)
    raw["model"].update(model)
    raw["optimizer"]["warmup_iters"] = 1
    raw["logging"].update(log_interval=STEPS, run_dir=str(tmp_path), tensorboard=True,
                          a2a_ranks_per_node=1)
    ranks = run_distributed(_counted_rank, world, timeout_s=240, args=(raw,), daemon=False)
    with open(tmp_path / "metrics.jsonl") as f:
        (record,) = [json.loads(line) for line in f if '"train"' in line]
    return ranks, record


def _check_equal_to_counted(ranks, record):
    """Every layer's logged per-rank bytes are one EP group's counted bytes, and the max over
    the stage's ranks is the counted maximum."""
    a2a = record["a2a"]
    layers = sorted({key[0] for r in ranks for key in r["sent"]})
    assert sorted(a2a) == [f"layer_{n}" for n in layers]
    for number in layers:
        entry = a2a[f"layer_{number}"]
        for key, logged in entry["per_rank"].items():
            group, direction = key.split("_")
            counted = {}
            for r in ranks:
                peers = r["sent"].get((number, group, direction))
                if peers is not None:
                    counted.setdefault(tuple(r["ep_ranks"]), {})[r["ep_ranks"].index(
                        ranks.index(r))] = peers
            groups = []
            for members in counted.values():
                matrix = [members[i] for i in range(len(members))]
                groups.append({"sent": [sum(row) for row in matrix],
                               "received": [sum(col) for col in zip(*matrix)]})
            assert logged in groups, (number, key, logged, groups)
            top = max(max(g["sent"]) for g in groups)
            assert entry[f"{key}_sent_max"] * STEPS == pytest.approx(top), (number, key)
        assert entry["dispatch_fwd_bookkeeping_mean"] > 0
        assert set(entry["would_send"]) >= {"row", "rank", "node"}


def test_live_metrics_equal_counted_bytes_ep2_dedup_node(tmp_path, text_tokens):
    from megatron_mvmoe.training.a2a_metrics import summary_line

    ranks, record = _train(tmp_path, text_tokens, {"ep": 2}, 2, moe_dispatcher="dedup_node",
                           moe_dispatch_ranks_per_node=1)
    _check_equal_to_counted(ranks, record)
    entry = record["a2a"]["layer_1"]
    assert entry["semantics"] == "node" and 0 < entry["inter_node_share"] <= 1
    assert entry["would_send"]["node"] == entry["dispatch_fwd_sent_mean"]
    assert "row/rank/node would send" in summary_line(record["a2a"])
    (events,) = glob.glob(os.path.join(tmp_path, "tensorboard", "*tfevents*"))
    with open(events, "rb") as f:
        assert b"train/a2a/layer_1/dispatch_fwd_sent_mean" in f.read()
    import plot_a2a_metrics  # the docs' plot, from this run's metrics.jsonl

    png = tmp_path / "a2a.png"
    assert plot_a2a_metrics.main([str(tmp_path / "metrics.jsonl"), "--out", str(png)]) == 0
    assert png.stat().st_size > 0
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"kind": "train", "step": 1}\n')
    assert plot_a2a_metrics.main([str(empty), "--out", str(png)]) == 2


@pytest.mark.parametrize("parallel", [{"tp": 2, "ep": 2, "etp": 1}, {"pp": 2, "ep": 2}],
                         ids=["tp2xep2", "pp2xep2"])
def test_live_metrics_at_tp_and_pp_layouts(tmp_path, text_tokens, parallel):
    ranks, record = _train(tmp_path, text_tokens, parallel, 4)
    _check_equal_to_counted(ranks, record)
    assert record["a2a"]["layer_1"]["semantics"] == "row"
