"""tools/compare.py --downstream: the downstream table (points, mean ± std over seeds,
paired Δ of the macro mean with its 95 % t interval, chance row), its refusal without
--save-dir, and a stored run re-scored only when the task spec changes."""

import pytest

from megatron_mvmoe.analysis.compare.downstream import downstream_table, spec


def _run(seed, arc, piqa):
    return {"seed": seed, "downstream": {"tasks": {"arc_easy": arc, "piqa": piqa},
                                         "chance": {"arc_easy": 0.25, "piqa": 0.5},
                                         "mean": (arc + piqa) / 2,
                                         "spec": spec(["arc_easy", "piqa"], 4)}}


def test_downstream_table_hand_case():
    base = [_run(1, 0.25, 0.50), _run(2, 0.30, 0.50)]
    mv = [_run(1, 0.35, 0.50), _run(2, 0.40, 0.52)]
    table = downstream_table({"latent": base, "multi_view": mv},
                             {"latent": "", "multi_view": "latent"})
    lines = table.splitlines()
    assert lines[0] == ("| variant | seeds | arc_easy | piqa | macro mean | "
                        "Δ mean vs reference (points) |")
    assert lines[2] == "| latent | 2 | 27.5 ± 3.5 | 50.0 ± 0.0 | 38.8 ± 1.8 | reference |"
    # per-seed Δ of the mean: +5.0 and +6.0 points -> mean +5.5, t(1) 12.706 * 0.5 = 6.35
    assert lines[3].startswith("| multi_view | 2 | 37.5 ± 3.5 | 51.0 ± 1.4 | 44.2 ± 2.5 | "
                               "vs latent: paired Δ +5.50 [-0.85, +11.85]")
    assert "(unresolved)" in lines[3]
    assert lines[4] == "| chance | | 25.0 | 50.0 | | |"


def test_downstream_needs_save_dir(capsys):
    import compare

    code = compare.main(["--suite", "a", "--downstream", "standard"])
    assert code != 0 and "--save-dir" in capsys.readouterr().err


def test_a_stored_run_is_rescored_only_for_another_spec(tmp_path, monkeypatch):
    import argparse

    import compare
    from megatron_mvmoe.analysis.compare import downstream

    calls = []

    def fake(load, tasks, limit):  # the lm-eval run itself: tests/hf/test_downstream.py
        calls.append((load, limit))
        return dict(_run(1, 0.3, 0.5)["downstream"], spec=spec(tasks, limit), seconds=1.0)

    monkeypatch.setattr(downstream, "evaluate_checkpoint", fake)
    saved = []
    store = argparse.Namespace(save=lambda key, run: saved.append(key))
    args = argparse.Namespace(downstream=["arc_easy", "piqa"], downstream_limit=4,
                              save_dir=str(tmp_path))
    variant, run, payload = argparse.Namespace(name="latent"), {}, {"errors": {}}
    compare.score_downstream(run, variant, 1, args, store, "k", payload)
    compare.score_downstream(run, variant, 1, args, store, "k", payload)
    assert calls == [(str(tmp_path / "latent_seed1"), 4)] and saved == ["k"]
    args.downstream_limit = 8
    compare.score_downstream(run, variant, 1, args, store, "k", payload)
    assert len(calls) == 2 and run["downstream"]["spec"]["limit"] == 8 and not payload["errors"]
