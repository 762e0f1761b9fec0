"""A training run with the dedup dispatcher selected by the config (model.moe_dispatcher):
a tiny Multi-View model at EP = 2 trains with dedup per rank and per node (one rank per
node, so both hops run), and its losses equal the per-row alltoall run's step by step within
5e-7 (measured: 1.2e-7 at one step of six, the others bit-equal; tests/layers/
test_a2a_dedup.py holds the layer outputs to 1e-5)."""

import copy

import pytest

from megatron_mvmoe.config.run_config import config_from_dict
from megatron_mvmoe.testing.spawn import run_distributed

from harness import tiny_run, train

STEPS = 6


def _built_dispatchers(rank, world_size, raw):
    """The dispatcher of every MoE layer the trainer's build (models.build) gives `raw`."""
    from megatron_mvmoe.models.build import build_model
    from megatron_mvmoe.parallel import initialize_layout

    run = config_from_dict(copy.deepcopy(raw))
    model = build_model(run, initialize_layout(run.parallel.layout()))[0]
    return [(type(m.token_dispatcher).__name__, m.token_dispatcher.semantics)
            for m in model.modules() if hasattr(m, "token_dispatcher")]


@pytest.fixture(scope="module")
def alltoall_losses(text_tokens):
    return train(tiny_run(text_tokens, parallel={"ep": 2}, train_iters=STEPS), 2)["losses"]


@pytest.mark.parametrize("dispatcher", ["dedup_rank", "dedup_node"])
def test_dedup_dispatch_trains_like_alltoall(text_tokens, alltoall_losses, dispatcher):
    raw = tiny_run(text_tokens, parallel={"ep": 2}, train_iters=STEPS)
    raw["model"].update(moe_dispatcher=dispatcher, moe_dispatch_ranks_per_node=1)
    semantics = dispatcher.split("_")[1]
    built = run_distributed(_built_dispatchers, 2, args=(raw,))[0]
    assert built and built == [("DedupAlltoAllTokenDispatcher", semantics)] * len(built)
    losses = train(raw, 2)["losses"]
    assert len(losses) == len(alltoall_losses) == STEPS
    assert losses[-1] < losses[0] - 0.05, losses  # it trains
    # 5e-7 (one fp32 ulp of a loss near 6), tighter than the layer tests' 1e-5 on outputs:
    # at this size a routed expert moves the loss little (the dedup dispatcher with its
    # routing probs x 1.1 moves it by up to 3e-6, and this test fails)
    assert losses == pytest.approx(alltoall_losses, rel=0, abs=5e-7), (
        losses, alltoall_losses)


def test_a_checkpoint_resumes_with_another_dispatcher_and_says_so(text_tokens, tmp_path,
                                                                  capfd):
    """Dispatchers and the gamma ramp hold no parameters: a resume may change them (the
    fingerprint compares structural fields only) and the log names each change once."""
    root = str(tmp_path / "ck")
    train(tiny_run(text_tokens, train_iters=3, eval_iters=0, save=root, save_interval=3), 1)
    resumed = tiny_run(text_tokens, train_iters=4, eval_iters=0, load=root)
    resumed["model"].update(moe_dispatcher="dedup_rank")
    resumed["model"]["multi_view"]["gamma_ramp_steps"] = 9
    out = train(resumed, 1)
    assert out["first_step"] == 4 and len(out["losses"]) == 1
    notes = [line for line in capfd.readouterr().out.splitlines()
             if line.startswith("resume: model fields")]
    assert len(notes) == 1 and notes[0].endswith(
        "this run's apply: moe_dispatcher: checkpoint 'alltoall' -> this run 'dedup_rank'; "
        "multi_view.gamma_ramp_steps: checkpoint 5 -> this run 9"), notes
