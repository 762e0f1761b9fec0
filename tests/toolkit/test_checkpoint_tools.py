"""tools/evaluate.py equals the trainer's own evaluation; tools/generate.py prints text from a
checkpoint, greedy and top-p, the same tokens at EP=2 as on one rank."""

import json
import os
import subprocess
import sys

import pytest
import torch

from harness import train
from textdata import build_megatron_prefixes

from megatron_mvmoe.config.flags import config_from_args
from megatron_mvmoe.testing.spawn import free_port
from megatron_mvmoe.toolkit.generation import top_p_filter

pytestmark = pytest.mark.timeout(600)
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Multi-View MoE trained 12 steps on two Megatron prefixes, saved at the end."""
    prefixes = build_megatron_prefixes(str(tmp_path_factory.mktemp("megatron_data")))
    root = str(tmp_path_factory.mktemp("ck"))
    run = config_from_args([
        "--model-preset", "tiny_multi_view", "--seq-length", "32", "--train-iters", "12",
        "--global-batch-size", "8", "--micro-batch-size", "2", "--eval-iters", "2",
        "--eval-interval", "0", "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "1",
        "--gamma-ramp-steps", "4", "--tensorboard", "false", "--save", root,
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", prefixes["tokenizer"],
        "--data-path", "0.5", prefixes["tech"], "0.5", prefixes["reference"],
        "--split", "90,10,0"])
    run.model.vocab_size = None
    out = train(run.to_dict(), 1)
    return {"root": root, "eval": out["eval"], "prefixes": prefixes}


def _tool(name, *args, nproc=1):
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                 "--master-port", str(free_port())] if nproc > 1 else [sys.executable])
    proc = subprocess.run(launcher + [f"tools/{name}.py", *args, "--json"], env=ENV,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout[proc.stdout.index("{"):])


def test_evaluate_equals_the_trainers_evaluation(trained):
    result = _tool("evaluate", "--load", trained["root"])
    assert result["step"] == 12
    assert set(result["components"]) == set(trained["eval"]) == {
        "tech_text_document", "reference_text_document"}
    for name, loss in trained["eval"].items():
        assert abs(result["components"][name]["loss"] - loss) < 1e-6, (name, result, loss)


def test_evaluate_on_jsonl_and_prefixes(trained):
    jsonl = trained["prefixes"]["jsonl"]["tech"]
    result = _tool("evaluate", "--load", trained["root"], "--input-jsonl", jsonl,
                   "--eval-iters", "1")
    assert list(result["components"]) == ["tech_text_document"]
    assert 1.0 < result["components"]["tech_text_document"]["ppl"] < 512


def test_generate_greedy_and_top_p_and_ep2_agree(trained):
    prompt = "The Python tutorial"
    one = _tool("generate", "--load", trained["root"], "--prompt", prompt,
                "--max-new-tokens", "12", "--no-stop-at-eod")
    text = one["outputs"][0]["text"]
    assert len(one["outputs"][0]["tokens"]) == 12 and text.strip(), one
    ep2 = _tool("generate", "--load", trained["root"], "--prompt", prompt, "--max-new-tokens",
                "12", "--no-stop-at-eod", "--expert-model-parallel-size", "2", nproc=2)
    assert ep2["outputs"][0]["tokens"] == one["outputs"][0]["tokens"]
    sampled = _tool("generate", "--load", trained["root"], "--prompt", prompt,
                    "--max-new-tokens", "12", "--no-stop-at-eod", "--top-p", "0.9",
                    "--seed", "7")
    assert len(sampled["outputs"][0]["tokens"]) == 12


def test_top_p_filter_matches_a_naive_nucleus():
    torch.manual_seed(0)
    for _ in range(20):
        logits = torch.randn(30)
        p = float(torch.rand(1)) * 0.9 + 0.05
        probs = torch.softmax(logits, -1)
        order = sorted(range(30), key=lambda i: -float(probs[i]))
        keep, mass = set(), 0.0
        for i in order:  # the smallest prefix of the sorted tokens with mass >= p
            keep.add(i)
            mass += float(probs[i])
            if mass >= p:
                break
        kept = {i for i, v in enumerate(top_p_filter(logits, p)) if v != float("-inf")}
        assert kept == keep


def _generate_every_variant(rank, world_size, presets):
    from megatron_mvmoe.config.run_config import config_from_dict
    from megatron_mvmoe.parallel import initialize_layout
    from megatron_mvmoe.toolkit.generation import SamplingConfig, generate
    from megatron_mvmoe.training.build import build_trainer

    out = {}
    for preset in presets:
        run = config_from_dict({"model": {"preset": preset, "vocab_size": 128,
                                          "seq_length": 16},
                                "parallel": {"ep": 1 if preset == "tiny_dense" else world_size}})
        pgs = initialize_layout(run.parallel.layout())
        trainer = build_trainer(run, pgs)
        out[preset] = generate(trainer.unwrapped()[0], [1, 2, 3], SamplingConfig(
            max_new_tokens=20, greedy=False, top_p=0.8), seq_length=16, vocab_size=100)
        from megatron_mvmoe.parallel import destroy_layout
        destroy_layout()
    return out


def test_generate_works_for_every_variant_at_ep2():
    from megatron_mvmoe.testing.spawn import run_distributed

    presets = ["tiny_dense", "tiny_smoe", "tiny_latent", "tiny_multi_router",
               "tiny_multi_view", "tiny_mh_moe"]
    per_rank = run_distributed(_generate_every_variant, 2, timeout_s=300, args=(presets,))
    for preset in presets:
        tokens = per_rank[0][preset]
        assert tokens == per_rank[1][preset] and len(tokens) == 20, preset
        assert max(tokens) < 100  # padded vocabulary rows are never chosen (window > 16 too)


def test_lm_eval_runs_the_local_task_offline(trained, tmp_path):
    pytest.importorskip("lm_eval")
    jsonl = trained["prefixes"]["jsonl"]["reference"]
    result = _tool("lm_eval_run", "--load", trained["root"], "--task-source", jsonl,
                   "--num-docs", "20", "--task-dir", str(tmp_path / "task"))
    metrics = result["results"]["mvmoe_continuation"]
    assert 0.0 <= metrics["acc"] <= 1.0 and 0.0 <= metrics["acc_norm"] <= 1.0
    assert result["n_samples"]["mvmoe_continuation"]["effective"] == 20


def test_lm_eval_scores_equal_megatrons_own_loss(trained, tmp_path):
    """MVMoELM.score is minus Megatron's own per-token training loss (vocab-parallel cross
    entropy over the padded vocabulary) summed over the target, from one forward with labels
    done here by hand: padded rows count in the softmax, as they do in training."""
    pytest.importorskip("lm_eval")
    from megatron_mvmoe.testing.spawn import run_distributed

    out = run_distributed(_score_both_ways, 1, timeout_s=200, args=(trained["root"],))[0]
    assert out["padded_rows"] > 0, out  # the checkpoint has padded rows to count
    assert abs(out["mine"] - out["megatron"]) < 1e-4, out


def _score_both_ways(rank, world_size, root):
    from megatron_mvmoe.evaluation.lm_eval_model import MVMoELM

    lm = MVMoELM(load=root)
    context = lm.tokenizer.tokenize("The tutorial shows how")
    target = lm.tokenizer.tokenize(" to write a function")
    mine, _ = lm.score(context, target)
    import torch

    full = torch.tensor([context + target])
    positions = torch.arange(full.shape[1] - 1)[None]
    with torch.no_grad():
        logits = lm.model(full[:, :-1], positions, None)
        loss = lm.model(full[:, :-1], positions, None, labels=full[:, 1:])  # [1, S] per token
    megatron = -float(loss[0, len(context) - 1:].sum())
    return {"mine": mine, "megatron": megatron,
            "padded_rows": logits.shape[-1] - lm.tokenizer.vocab_size}
