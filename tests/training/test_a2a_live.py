"""Live all-to-all metrics of a training run (training/a2a_metrics.py) equal the bytes
counted at torch.distributed for the same steps, per rank and MoE layer, bookkeeping
included: EP = 2 with the dedup_node dispatcher (two hops, one rank per node); the
TP x EP, PP x EP and CP x EP layouts with Megatron's alltoall rows; MH-MoE sub-tokens,
expert capacity (dropping, padded), expert TP x EP and the allgather dispatcher. Also in
metrics.jsonl, TensorBoard, the console summary and tools/plot_a2a_metrics.py. On CPU/gloo;
the NCCL test runs where 2 GPUs are present."""

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
    return "combine" if phase in ("combine_preprocess", "token_combine") else "dispatch"


def _counted_rank(rank, world_size, raw):
    """Train under the collective counter; the bytes this rank handed to each global rank per
    (layer number, dispatch | combine, fwd | bwd) over every dispatcher collective, and its
    TP x EP group (the live metrics' ranks)."""
    from megatron_mvmoe.analysis.a2a.counter import count_collectives
    from megatron_mvmoe.analysis.a2a.volume import sent_to_ranks
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
    for layer, keys in sent_to_ranks(counter.records).items():
        for (phase, direction, _), peers in keys.items():
            into = sent.setdefault((int(layer), _phase_group(phase), direction), {})
            for peer, nbytes in peers.items():
                into[peer] = into.get(peer, 0) + nbytes
    return {"sent": sent, "group": dist.get_process_group_ranks(pgs.tp_ep),
            "rank": dist.get_rank()}


def _train(tmp_path, text_tokens, parallel, world, backend="gloo", **model):
    raw = tiny_run(text_tokens, parallel=parallel, train_iters=STEPS, eval_iters=0)
    raw["model"].update(model)
    raw["optimizer"]["warmup_iters"] = 1
    raw["logging"].update(log_interval=STEPS, run_dir=str(tmp_path), tensorboard=True,
                          a2a_ranks_per_node=1)
    ranks = run_distributed(_counted_rank, world, timeout_s=240, args=(raw,), daemon=False,
                            backend=backend)
    with open(tmp_path / "metrics.jsonl") as f:
        (record,) = [json.loads(line) for line in f if '"train"' in line]
    return ranks, record


def _check_equal_to_counted(ranks, record):
    """Every layer's logged per-rank bytes are one TP x EP group's counted bytes, and the max
    over the stage's ranks is the counted maximum."""
    a2a, by_rank = record["a2a"], {r["rank"]: r for r in ranks}
    layers = sorted({key[0] for r in ranks for key in r["sent"]})
    assert sorted(a2a) == [f"layer_{n}" for n in layers]
    for number in layers:
        entry = a2a[f"layer_{number}"]
        for key, logged in entry["per_rank"].items():
            group, direction = key.split("_")
            counted = []
            for members in {tuple(r["group"]) for r in ranks}:
                sent = [by_rank[s]["sent"].get((number, group, direction)) for s in members]
                if any(row is not None for row in sent):
                    matrix = [[(row or {}).get(d, 0) for d in members] for row in sent]
                    counted.append({"sent": [sum(row) for row in matrix],
                                    "received": [sum(col) for col in zip(*matrix)]})
            assert logged in counted, (number, key, logged, counted)
            top = max(max(g["sent"]) for g in counted)
            assert entry[f"{key}_sent_max"] * STEPS == pytest.approx(top), (number, key)
        assert set(entry["would_send"]) >= {"row", "rank", "node"}


def test_live_metrics_equal_counted_bytes_ep2_dedup_node(tmp_path, text_tokens):
    from megatron_mvmoe.training.a2a_metrics import summary_line

    ranks, record = _train(tmp_path, text_tokens, {"ep": 2}, 2, moe_dispatcher="dedup_node",
                           moe_dispatch_ranks_per_node=1)
    _check_equal_to_counted(ranks, record)
    entry = record["a2a"]["layer_1"]
    assert entry["dispatch_fwd_bookkeeping_mean"] > 0
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


CAPACITY_DROP = {"extra": {"moe_expert_capacity_factor": 0.75}}
CAPACITY_PAD = {"extra": {"moe_expert_capacity_factor": 1.0,
                          "moe_pad_expert_input_to_capacity": True}}
CASES = {  # id: (parallel, world, model overrides, what the dispatcher sends)
    "mh_moe_dropping": ({"ep": 2}, 2, {"preset": "tiny_mh_moe", **CAPACITY_DROP}, "row"),
    # padded: every rank receives C*E rows, so gloo's all-gather over the expert-TP group is
    # Megatron's (uneven splits are padded on gloo by platform/cpu_uneven_gather.py, which
    # NCCL does not need: the live metrics count Megatron's uneven all-gather)
    "etp2xep2_padded": ({"ep": 2, "etp": 2}, 4, CAPACITY_PAD, "row"),
    "allgather_etp2xep2": ({"ep": 2, "etp": 2}, 4, {
        "preset": "tiny_latent", "extra": {"moe_token_dispatcher_type": "allgather"}},
        "allgather"),
    "cp2xep2": ({"cp": 2, "ep": 2}, 4, {}, "row"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_live_metrics_equal_counted_bytes_everywhere(tmp_path, text_tokens, case):
    """MH-MoE sub-tokens, expert capacity (dropping: the kept rows; padded: C*E rows and no
    count all-gather), expert TP (the all-gather and reduce-scatter over the expert-TP
    group), the allgather dispatcher and context parallelism: live == counted."""
    parallel, world, model, semantics = CASES[case]
    ranks, record = _train(tmp_path, text_tokens, parallel, world, **copy.deepcopy(model))
    _check_equal_to_counted(ranks, record)
    assert {e["semantics"] for e in record["a2a"].values()} == {semantics}
    if semantics == "allgather":  # its own figure beside what row / rank / node would send
        import plot_a2a_metrics

        entry = record["a2a"]["layer_1"]
        assert entry["would_send"]["allgather"] == pytest.approx(
            entry["dispatch_fwd_sent_mean"])
        png = tmp_path / "a2a.png"
        assert plot_a2a_metrics.main([str(tmp_path / "metrics.jsonl"), "--out", str(png)]) == 0


@pytest.mark.gpu
def test_live_metrics_equal_counted_bytes_on_nccl(tmp_path, text_tokens):
    """The same equality on GPUs over NCCL (routing maps, histograms and the metrics'
    all-reduces on the device): EP 2 with the dedup_node dispatcher. Needs 2 GPUs."""
    import torch

    if torch.accelerator.device_count() < 2:
        pytest.skip("EP 2 over NCCL needs 2 GPUs")
    ranks, record = _train(tmp_path, text_tokens, {"ep": 2}, 2, backend="nccl",
                           moe_dispatcher="dedup_node", moe_dispatch_ranks_per_node=1)
    _check_equal_to_counted(ranks, record)
