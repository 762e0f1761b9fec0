"""Training on real text through Megatron's engine: the loss falls at EP=2, layouts agree,
resume is bit-identical, a checkpoint loads on another layout, and mistakes fail clearly."""

import hashlib
import json
import os

import pytest
import torch

from megatron_mvmoe.testing.spawn import DistributedTestError
from harness import tiny_run, train, with_dropout

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def init_ckpt(text_tokens, tmp_path_factory):
    """An untrained tiny Multi-View model saved at EP=1 (train_iters=0): shared weights."""
    root = str(tmp_path_factory.mktemp("init"))
    train(tiny_run(text_tokens, train_iters=0, eval_iters=0, save=root), 1)
    return root


def test_loss_falls_at_ep2(text_tokens):
    out = train(tiny_run(text_tokens, parallel={"ep": 2}, train_iters=20), 2)
    losses = out["losses"]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    assert set(out["eval"]) == {"tech", "reference"}


def test_loss_falls_at_tp2_pp2(text_tokens):
    # EP=2 rides along: with TP > 1, experts need ep > 1 or etp = tp (parallel.py guard).
    out = train(tiny_run(text_tokens, parallel={"tp": 2, "pp": 2, "ep": 2}, train_iters=12,
                         eval_iters=1), 4)
    assert sum(out["losses"][-3:]) / 3 < out["losses"][0] - 0.3, out["losses"]


def _from_init(init_ckpt, steps):
    return dict(train_iters=steps, eval_iters=0, load=init_ckpt, load_optimizer=False)


@pytest.fixture(scope="module")
def one_rank_losses(text_tokens, init_ckpt):
    """10 steps on one rank from the shared initial weights (the parity reference)."""
    return train(tiny_run(text_tokens, **_from_init(init_ckpt, 10)), 1)["losses"]


@pytest.mark.parametrize("parallel,world,steps", [
    ({"ep": 2}, 2, 10), ({"pp": 2}, 2, 10),
    # TP=2 turns sequence parallelism on; the experts then need EP=2 (ETP=1) beside it
    # (parallel.py guard): 4 ranks, so only the first steps (each needs the previous ones).
    ({"tp": 2, "ep": 2, "etp": 1}, 4, 3)], ids=["ep2", "pp2", "tp2_sp_ep2"])
def test_layout_parity_first_steps(text_tokens, init_ckpt, one_rank_losses, parallel, world,
                                   steps):
    other = train(tiny_run(text_tokens, parallel=parallel, **_from_init(init_ckpt, steps)),
                  world)["losses"]
    reference = one_rank_losses[:steps]
    assert len(other) == steps and reference[-1] < reference[0]
    assert max(abs(a - b) for a, b in zip(reference, other)) < 1e-4, (reference, other)


def _dropout_run(text_tokens, parallel, **training):
    return with_dropout(tiny_run(text_tokens, parallel=parallel, **training))


def _rewind(root, step):
    with open(os.path.join(root, "latest"), "w") as fh:
        fh.write(f"iter_{step:07d}\n")


def _strip_tracker_states(directory):
    """Make `directory` a checkpoint as saved before the rng part kept Megatron's tracker
    states (its manifest entries rewritten as that save would have written them)."""
    manifest_path = os.path.join(directory, "manifest.json")
    with open(manifest_path) as fh:
        manifest = json.load(fh)
    for name in os.listdir(os.path.join(directory, "rng")):
        path = os.path.join(directory, "rng", name)
        state = torch.load(path, weights_only=True)
        del state["rng_tracker_states"]
        torch.save(state, path)
        with open(path, "rb") as fh:
            digest = hashlib.sha256(fh.read()).hexdigest()
        manifest["files"][f"rng/{name}"] = {"size": os.path.getsize(path), "sha256": digest}
    with open(manifest_path, "w") as fh:
        json.dump(manifest, fh)


def test_resume_is_bit_identical_and_reshards(text_tokens, tmp_path, capfd):
    """At EP=2 with dropout: the resumed steps equal the uninterrupted ones bit for bit (the
    checkpoint restores Megatron's RNG-tracker states too; one without them still resumes,
    saying once that the dropout streams restart), then the weights reshard."""
    root = str(tmp_path / "ck")
    full = train(_dropout_run(text_tokens, {"ep": 2}, train_iters=9, save=root,
                              save_interval=4), 2)
    _rewind(root, 4)  # resume from step 4, not 9
    resumed = train(_dropout_run(text_tokens, {"ep": 2}, train_iters=9, load=root), 2)
    assert resumed["first_step"] == 5
    assert resumed["losses"] == full["losses"][4:]  # steps 5..9, bit for bit
    _strip_tracker_states(os.path.join(root, "iter_0000004"))
    capfd.readouterr()
    older = train(_dropout_run(text_tokens, {"ep": 2}, train_iters=5, load=root), 2)
    assert older["losses"] != full["losses"][4:5]  # the attention-dropout masks restarted
    assert capfd.readouterr().out.count("rng: this checkpoint has no Megatron RNG-tracker "
                                        "states") == 1
    # Another layout: evaluate the step-4 weights at PP=2 and at EP=1 (no more steps; eval
    # runs without dropout).
    at_save = train(_dropout_run(text_tokens, {"ep": 2}, train_iters=4, load=root), 2)
    for parallel, world in (({"pp": 2}, 2), ({}, 1)):
        other = train(_dropout_run(text_tokens, parallel, train_iters=4, load=root), world)
        for domain, loss in at_save["eval"].items():
            assert abs(other["eval"][domain] - loss) < 1e-4, (parallel, domain)


@pytest.mark.parametrize("parallel,world", [({"pp": 2}, 2), ({"tp": 2, "ep": 2, "etp": 1}, 4)],
                         ids=["pp2", "tp2_sp_ep2"])
def test_resume_with_dropout_is_bit_identical(text_tokens, tmp_path, parallel, world):
    """PP=2 and TP=2 (sequence parallel: hidden dropout forks the tracker): resumed at step
    2, steps 3..4 equal the uninterrupted run's bit for bit."""
    root = str(tmp_path / "ck")
    full = train(_dropout_run(text_tokens, parallel, train_iters=4, eval_iters=0, save=root,
                              save_interval=2), world)
    _rewind(root, 2)
    resumed = train(_dropout_run(text_tokens, parallel, train_iters=4, eval_iters=0,
                                 load=root), world)
    assert resumed["losses"] == full["losses"][2:], (resumed["losses"], full["losses"])


def test_nonfinite_loss_names_step_and_layer(text_tokens):
    with pytest.raises(DistributedTestError, match=r"at step 3; first non-finite output: "
                                                   r"decoder\.layers\.1 \(layer 2\)"):
        train(tiny_run(text_tokens, train_iters=5, eval_iters=0), 1, corrupt_at_step=3)


def test_incompatible_checkpoint_names_fields(text_tokens, init_ckpt):
    raw = tiny_run(text_tokens, train_iters=3, eval_iters=0, load=init_ckpt)
    raw["model"]["hidden_size"] = 32
    with pytest.raises(DistributedTestError, match=r"incompatible model; differing fields: "
                                                   r"hidden_size: checkpoint 64 vs this run 32"):
        train(raw, 1)


def test_missing_checkpoint_is_clear(text_tokens, tmp_path):
    with pytest.raises(DistributedTestError, match="no checkpoint here"):
        train(tiny_run(text_tokens, train_iters=3, load=str(tmp_path)), 1)


def test_routing_metrics_logged_per_layer(text_tokens, tmp_path):
    """metrics.jsonl carries per-layer load (max/mean, CV) and, for the two-head Multi-View
    router, the inter-head rank correlation and the mixing entropy, every log interval."""
    import json

    raw = tiny_run(text_tokens, train_iters=5, eval_iters=0)
    raw["logging"].update(run_dir=str(tmp_path / "run"), log_interval=5)
    train(raw, 1)
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    routing = [r["routing"] for r in records if "routing" in r]
    assert routing, records
    for layer in routing[-1].values():
        tokens = torch.tensor(layer["tokens_per_expert"], dtype=torch.float64)
        assert tokens.sum() > 0
        mean = tokens.mean()  # CV and max/mean recomputed from the logged counts
        assert layer["load_cv"] == pytest.approx(float(tokens.std(unbiased=False) / mean))
        assert layer["load_max_over_mean"] == pytest.approx(float(tokens.max() / mean))
        assert -1.0 <= layer["head_rank_correlation"] <= 1.0
        assert 0.0 < layer["mixing_entropy"] <= 1.0


def test_router_trace_and_tracker_losses_for_multi_router(text_tokens, tmp_path):
    """--moe-routing-trace-path writes Megatron's JSONL router trace for MultiRouter layers
    (one record per traced micro-batch and MoE layer, the dispatched top-k), and the z-loss the
    router records into Megatron's MoEMetricsTracker reaches metrics.jsonl per layer."""
    import json

    raw = tiny_run(text_tokens, train_iters=4, eval_iters=0)
    raw["model"]["extra"] = {"moe_z_loss_coeff": 1e-3}
    raw["logging"].update(run_dir=str(tmp_path / "run"), log_interval=4,
                          moe_routing_trace_path=str(tmp_path / "trace"),
                          moe_routing_trace_max_iters=3)
    train(raw, 1)
    records = [json.loads(line) for line in open(tmp_path / "trace" / "router_trace_rank0.jsonl")]
    layers = sorted({r["layer"] for r in records})
    assert layers and sorted({r["step"] for r in records}) == [1, 2, 3]
    microbatches = 8 // 2  # global batch 8, micro-batch 2, one rank: a record per forward
    assert len(records) == 3 * len(layers) * microbatches  # stopped after max_iters
    for record in records:
        indices = record["top_indices"]
        assert len(indices) == record["num_tokens"] and all(len(row) == record["topk"]
                                                            for row in indices)
        assert all(len(set(row)) == len(row) for row in indices)  # distinct experts
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    routing = [m["routing"] for m in metrics if "routing" in m][-1]
    assert all(layer["z_loss"] > 0 for layer in routing.values()), routing
