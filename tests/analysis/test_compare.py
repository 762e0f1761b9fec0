"""compare: report aggregation (hand-computed), variant configs, and the tool end to end on
a tiny token corpus (2 variants x 2 seeds x a few steps)."""
import json
import math
import os

import numpy as np
import pytest

from megatron_mvmoe.analysis.compare.report import (
    Cell, inside_noise, markdown_table, perplexity_cells)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_perplexity_cells_hand_case():
    runs = [{"eval": {"a": math.log(10.0), "b": math.log(20.0)}},
            {"eval": {"a": math.log(12.0), "b": math.log(24.0)}}]
    cells = perplexity_cells(runs)
    assert cells["a"].mean == pytest.approx(11.0) and cells["a"].std == pytest.approx(math.sqrt(2))
    assert cells["mean"].mean == pytest.approx(16.5)  # mean of (15, 18)
    assert cells["a"].n == 2


def test_final_loss_cell():
    from megatron_mvmoe.analysis.compare.report import final_loss_cell

    cell = final_loss_cell([{"losses": [9.0, 2.0, 4.0]}, {"losses": [9.0, 4.0, 6.0]}], last=2)
    assert (cell.mean, cell.n) == (4.0, 2) and cell.std == pytest.approx(math.sqrt(2))


def test_inside_noise():
    ref = Cell(10.0, 1.0, 3)
    assert inside_noise(Cell(10.5, 1.0, 3), ref) is True
    assert inside_noise(Cell(13.0, 0.1, 3), ref) is False
    assert inside_noise(Cell(13.0, 0.0, 1), ref) is None


def test_markdown_table_marks_reference_and_noise():
    runs = lambda *p: [{"eval": {"x": math.log(v)}, "losses": [v, v]} for v in p]  # noqa: E731
    table = markdown_table({"base": runs(10, 11, 12), "new": runs(10.5, 11.5, 12.5),
                            "far": runs(30, 31, 32)},
                           {"new": "base", "far": "base", "base": ""})
    lines = table.strip().splitlines()
    assert "reference" in lines[2]
    assert "inside seed noise" in lines[3] and "outside seed noise" in lines[4]
    # paired: 'new' is exactly +0.5 ppl on every seed -> zero spread, a resolved difference
    assert "paired Δ +0.50 [+0.50, +0.50], detectable ±0.00 (resolved)" in lines[3]


def test_paired_interval_and_detectable_difference_hand_case():
    """Deltas 1..5: mean 3, sd sqrt(2.5), t_{0.975,4} = 2.7764, t_{0.8,4} = 0.9410."""
    from megatron_mvmoe.analysis.stats import paired_difference, student_t_quantile

    assert student_t_quantile(0.975, 4) == pytest.approx(2.7764, abs=1e-4)
    assert student_t_quantile(0.975, 2) == pytest.approx(4.3027, abs=1e-4)
    assert student_t_quantile(0.975, 10 ** 4) == pytest.approx(1.9600, abs=1e-3)
    d = paired_difference([1, 2, 3, 4, 5])
    se = math.sqrt(2.5) / math.sqrt(5)
    assert d.low == pytest.approx(3 - 2.7764 * se, abs=1e-3) and d.verdict() == "higher"
    assert d.detectable == pytest.approx((2.7764 + 0.9410) * se, abs=1e-3)
    assert paired_difference([-1, 1, 0.5]).verdict() == "unresolved"
    with pytest.raises(ValueError, match="--seeds"):
        paired_difference([1.0])


def test_orderings_pair_by_seed_and_say_what_appears():
    from megatron_mvmoe.analysis.compare.report import ordering_rows, orderings_table

    def runs(values, seeds=None):
        return [{"eval": {"x": math.log(v)}, "seed": s}
                for v, s in zip(values, seeds or range(1, len(values) + 1))]

    results = {"good": runs([9, 10.1, 11, 12.2, 13]), "base": runs([10, 11, 12, 13, 14]),
               "noisy": runs([8, 12, 11, 14, 13]),
               "late": runs([15, 12.1, 14.05], seeds=[5, 2, 4])}  # out of order: paired by seed
    rows = ordering_rows(results, [("good", "base", "p"), ("base", "good", "p"),
                                   ("noisy", "base", "p"), ("late", "base", "p"),
                                   ("good", "missing", "p")])
    assert [r["seen"] for r in rows] == ["appears", "reversed", "not resolved", "reversed",
                                         "not run"]
    assert rows[3]["paired"]["n"] == 3 and rows[3]["paired"]["mean"] == pytest.approx(
        (1 + 1.1 + 1.05) / 3)
    table = orderings_table(rows)
    assert "| good < base | p | -0.94 |" in table and table.count("\n") == 7


def test_loss_curves_leave_out_runs_resumed_mid_way():
    from megatron_mvmoe.analysis.compare.report import loss_curves

    curves = loss_curves({"a": [{"losses": [3, 2, 1]}, {"losses": [1.5], "first_step": 3}],
                          "b": [{"losses": [1.0], "first_step": 3}]})
    assert curves == {"a": [[3, 2, 1]]}


def test_run_store_is_resumable_and_keyed_by_setup(tmp_path):
    from megatron_mvmoe.analysis.compare.store import RunStore, run_key

    store = RunStore(str(tmp_path / "runs"))
    key = run_key("latent", {"preset": "tiny_latent"}, 1, {"train_iters": 1000})
    assert key != run_key("latent", {"preset": "tiny_latent"}, 1, {"train_iters": 999})
    assert key != run_key("latent", {"preset": "tiny_latent"}, 2, {"train_iters": 1000})
    assert store.load(key) is None
    store.save(key, {"eval": {"x": 1.0}})
    assert store.load(key) == {"eval": {"x": 1.0}}
    assert os.listdir(tmp_path / "runs") == [key + ".json"]  # no temporary left behind
    (tmp_path / "runs" / (key + ".json")).write_text("{half")
    with pytest.raises(ValueError, match="delete the file"):
        store.load(key)


def test_variants_keep_the_parity_recipes():
    from megatron_mvmoe.analysis.compare.suites import variants

    b = {v.name: v for v in variants("b")}
    assert b["mh_moe_h3"].model["num_experts"] == 96 and b["mh_moe_h3"].model["moe_router_topk"] == 3
    assert b["mh_moe_h2_shared"].reference == "smoe_shared"
    assert b["mh_moe_h2_head_only"].model["multi_head"]["merge_projection"] is False
    assert b["mh_moe_h3"].model["hidden_size"] // 3 == 32  # sub-tokens no longer 16 wide
    a = {v.name: v for v in variants("a")}
    assert a["multi_view_stopgrad"].model["multi_view"]["stop_grad_mixing"] is True
    t3 = {v.name: v for v in variants("t3")}
    assert all(v.model["bitnet"]["enabled"] for v in t3.values()) and "Table 3" in t3["mh_moe_h3"].note
    c = {v.name: v for v in variants("c")}
    views = c["multi_view_r4"].model["multi_view"]
    assert views["num_routers"] == views["num_views"] == 4
    assert c["multi_view_fine"].model["num_experts"] == 8 and c["latent"].model == a["latent"].model
    from megatron_mvmoe.analysis.compare.suites import ORDERINGS

    for suite, rows in ORDERINGS.items():  # every ordering names variants of its suite
        names = {v.name for v in variants(suite)}
        assert all(better in names and worse in names for better, worse, _ in rows), suite
    with pytest.raises(ValueError, match="suite"):
        variants("z")
    with pytest.raises(ValueError, match="not in suite a"):
        variants("a", ["smoe"])


def test_compare_tool_tiny(tmp_path, capsys):
    import compare

    data = tmp_path / "tok"
    data.mkdir()
    gen = np.random.default_rng(0)
    for domain in ("books", "tech"):
        for split in ("train", "valid"):
            np.save(data / f"{domain}_{split}.npy", gen.integers(0, 4096, 3000).astype(np.int32))
    out = tmp_path / "out"
    argv = ["--suite", "a", "--variants", "latent", "multi_view", "--seeds", "2",
            "--data-path", str(data), "--data-kind", "tokens", "--train-iters", "6",
            "--eval-iters", "1", "--global-batch", "4", "--micro-batch", "4",
            "--seq-length", "16", "--out-dir", str(out), "--runs-dir", str(tmp_path / "runs"),
            "--json"]
    code = compare.main(argv)
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and not payload["errors"]
    assert len(payload["runs"]) == 4 and payload["reused"] == []
    assert set(payload["runs"]["latent/seed1"]["eval"]) == {"books", "tech"}
    table = (out / "compare_a.md").read_text()
    assert "| latent | 2 |" in table and "vs latent" in table
    assert "| multi_view < latent |" in table and "## The papers' orderings" in table
    assert (out / "compare_a_loss.png").stat().st_size > 0
    # Resume: one stored run deleted (an interrupted session); the rerun trains only it.
    stored = sorted(os.listdir(tmp_path / "runs"))
    assert len(stored) == 4
    os.remove(tmp_path / "runs" / [f for f in stored if f.startswith("multi_view_seed2")][0])
    code = compare.main(argv)
    again = json.loads(capsys.readouterr().out)
    assert code == 0 and sorted(again["reused"]) == ["latent/seed1", "latent/seed2",
                                                     "multi_view/seed1"]
    assert again["runs"]["latent/seed1"]["eval"] == payload["runs"]["latent/seed1"]["eval"]
    assert again["runs"]["multi_view/seed2"]["eval"] == payload["runs"]["multi_view/seed2"]["eval"]
    # --from-store: tables from what the store holds, nothing trained, the gap listed.
    stored = sorted(os.listdir(tmp_path / "runs"))
    os.remove(tmp_path / "runs" / [f for f in stored if f.startswith("latent_seed2")][0])
    code = compare.main(argv + ["--from-store"])
    partial = json.loads(capsys.readouterr().out)
    assert code == 0 and partial["missing"] == ["latent/seed2"] and len(partial["runs"]) == 3
    assert len(os.listdir(tmp_path / "runs")) == 3  # still: nothing was trained
    assert "**Partial (--from-store): 3 of 4 runs" in (out / "compare_a.md").read_text()


def test_compare_run_killed_mid_way_resumes_from_its_checkpoint(tmp_path, capsys):
    import compare

    data = tmp_path / "tok"
    data.mkdir()
    gen = np.random.default_rng(1)
    for split in ("train", "valid"):
        np.save(data / f"books_{split}.npy", gen.integers(0, 4096, 3000).astype(np.int32))
    ckpt, runs = tmp_path / "ckpt", tmp_path / "runs"
    argv = ["--suite", "a", "--variants", "latent", "--seeds", "1", "--data-path", str(data),
            "--data-kind", "tokens", "--train-iters", "6", "--eval-iters", "1",
            "--global-batch", "4", "--micro-batch", "4", "--seq-length", "16",
            "--out-dir", str(tmp_path / "out"), "--runs-dir", str(runs),
            "--save-dir", str(ckpt), "--save-interval", "3", "--json"]
    assert compare.main(argv) == 0
    full = json.loads(capsys.readouterr().out)["runs"]["latent/seed1"]
    # As if killed after step 3: no stored run, the run's latest checkpoint is step 3.
    for name in os.listdir(runs):
        os.remove(runs / name)
    (ckpt / "latent_seed1" / "latest").write_text("iter_0000003\n")
    assert compare.main(argv) == 0
    resumed = json.loads(capsys.readouterr().out)["runs"]["latent/seed1"]
    assert resumed["first_step"] == 4 and resumed["losses"] == full["losses"][3:]
    assert resumed["eval"] == full["eval"]


@pytest.mark.parametrize("suite,variant", [("t3", "mh_moe_h3"), ("c", "multi_view_fine")])
def test_new_suites_train(tmp_path, capsys, suite, variant):
    """Seed 001 Table 3 (BitNet MH-MoE h=3) and Multi-View on fine-grained experts run."""
    import compare

    data = tmp_path / "tok"
    data.mkdir()
    gen = np.random.default_rng(2)
    for split in ("train", "valid"):
        np.save(data / f"books_{split}.npy", gen.integers(0, 4096, 3000).astype(np.int32))
    code = compare.main(["--suite", suite, "--variants", variant, "--seeds", "1",
                         "--data-path", str(data), "--data-kind", "tokens", "--train-iters",
                         "2", "--eval-iters", "1", "--global-batch", "2", "--micro-batch", "2",
                         "--seq-length", "16", "--out-dir", str(tmp_path / "out"),
                         "--runs-dir", str(tmp_path / "runs"), "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and not payload["errors"], payload["errors"]
    assert math.isfinite(payload["runs"][f"{variant}/seed1"]["eval"]["books"])


def test_data_commands_and_full_eval_iters(tmp_path):
    from megatron_mvmoe.analysis.compare.data import (
        DataRecipe, build_commands, ensure_dataset, full_eval_iters)

    corpus_cmd, tok_cmd = build_commands(str(tmp_path / "d"), DataRecipe(3.0, 4096, 2.0))
    assert corpus_cmd[1].endswith("tools/build_corpus.py") and corpus_cmd[-1] == "3"
    assert corpus_cmd[corpus_cmd.index("--out") + 1] == str(tmp_path / "d" / "corpus")
    assert tok_cmd[tok_cmd.index("--vocab-size") + 1] == "4096"
    assert tok_cmd[tok_cmd.index("--out") + 1] == str(tmp_path / "d")
    # an existing dataset is used as is (no commands run)
    meta = {"prefixes": {"a.train": {"tokens": 10 ** 6}, "a.valid": {"tokens": 1000},
                         "b.valid": {"tokens": 641}}}
    (tmp_path / "dataset_meta.json").write_text(json.dumps(meta))
    assert ensure_dataset(str(tmp_path), DataRecipe()).commands == []
    # smallest valid split: (641 - 1) // 16 = 40 samples -> 40 // 4 = 10 microbatches
    assert full_eval_iters(str(tmp_path), seq_length=16, micro_batch=4) == 10
    # .bin files without the meta file: refused, not overwritten
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "x.bin").write_bytes(b"\0")
    with pytest.raises(ValueError, match="dataset_meta.json"):
        ensure_dataset(str(stray), DataRecipe())


def test_compare_tool_builds_indexed_data(tmp_path, capsys):
    """One command from nothing: the data tools run, then training on the indexed kind."""
    import compare

    data, out = tmp_path / "tok", tmp_path / "out"
    code = compare.main(["--suite", "a", "--variants", "latent", "--seeds", "1",
                         "--data-path", str(data), "--corpus-mb", "0.03", "--vocab-size",
                         "300", "--bpe-train-mb", "0.03", "--train-iters", "3",
                         "--global-batch", "4", "--micro-batch", "4", "--seq-length", "16",
                         "--out-dir", str(out), "--runs-dir", str(tmp_path / "runs"),
                         "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    payload = json.loads(captured.out)
    assert not payload["errors"], payload["errors"]
    assert (data / "dataset_meta.json").is_file() and (data / "corpus").is_dir()
    assert [c.split()[1] for c in payload["data"]["built_with"]] == [
        "tools/build_corpus.py", "tools/preprocess_data.py"]
    assert payload["data"]["kind"] == "indexed"
    assert set(payload["runs"]["latent/seed1"]["eval"]) == {"books", "reference", "tech"}
    table = (out / "compare_a.md").read_text()
    assert "built by this command" in table and "tools/preprocess_data.py" in table


def test_committed_run_store_is_found_by_todays_variants():
    """Every committed run is reachable: its key is that of a (suite variant, seed) at the
    default setup. A change to how variants are written (as the renovation made) fails this
    until the store is migrated, instead of silently retraining 10 hours of runs."""
    import compare

    from megatron_mvmoe.analysis.compare.store import run_key
    from megatron_mvmoe.analysis.compare.suites import SUITES, variants

    store = os.path.join(ROOT, "examples", "results", "compare_runs")
    reachable = set()
    for suite in SUITES:
        args = compare.parse_args(["--suite", suite])
        args.eval_iters = 10  # the whole valid split of data/compare_tok (full_eval_iters)
        shared = compare.setup(args)
        reachable |= {run_key(v.name, v.model, seed, shared)
                      for v in variants(suite) for seed in range(1, args.seeds + 1)}
    committed = {name[:-len(".json")] for name in os.listdir(store) if name.endswith(".json")}
    assert len(committed) >= 40 and committed <= reachable, sorted(committed - reachable)[:5]
