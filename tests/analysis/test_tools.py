"""The analysis tools end to end on tiny fresh models: argparse, --json output, exit codes."""
import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(module, argv, capsys):
    code = module.main(argv)
    return code, json.loads(capsys.readouterr().out)


def test_routing_alignment_tool(capsys, tmp_path):
    import routing_alignment

    plot = str(tmp_path / "align.png")
    code, out = _run(routing_alignment, [
        "--model", "single=tiny_latent", "--batches", "1", "--resamples", "20", "--json",
        "--set", "model.num_layers=1", "--plot", plot], capsys)
    assert code == 0
    (res,) = out["results"]
    assert res["label"] == "single" and res["variant"] == "latent"
    assert res["data"] == "synthetic-uniform"
    glob = res["utilities"]["norm"]["global"]
    assert glob["low"] <= glob["estimate"] <= glob["high"]
    assert os.path.getsize(plot) > 0


def test_mixing_intervention_tool(capsys):
    import mixing_intervention

    code, out = _run(mixing_intervention, [
        "--model", "tiny_multi_view", "--batches", "1", "--json",
        "--set", "model.gamma_ramp_steps=0", "--set", "model.num_layers=1"], capsys)
    assert code == 0
    assert out["identity_delta_exactly_zero"] and out["selection_and_gates_fixed"]
    assert out["gamma"] == 1.0
    assert [p["policy"] for p in out["policies"]] == [
        "identity", "view1", "view2", "uniform", "swapped"]


def test_router_report_tool(capsys):
    import router_report

    code, out = _run(router_report, [
        "--model", "tiny_multi_view", "--batches", "1", "--ep-size", "2", "--json",
        "--set", "model.num_layers=1"], capsys)
    assert code == 0
    (res,) = out["results"]
    (div,) = res["diversity"].values()
    assert set(div["rank_correlation"]) == {"r0-r1"} and div["chance_overlap"] == 0.5
    assert 0.0 <= div["mixing_entropy"] <= 1.0
    assert len(res["load"][0]["ranks"]["counts"]) == 2


def test_bad_model_spec_is_a_clear_error(capsys):
    import routing_alignment

    assert routing_alignment.main(["--model", "no_such_preset"]) == 2
    assert "not a directory, YAML file or preset" in capsys.readouterr().err


def test_bad_override_rejected():
    from megatron_mvmoe.toolkit.flags import parse_overrides

    assert parse_overrides(["model.num_layers=2"]) == {"model.num_layers": 2}
    with pytest.raises(ValueError, match="section.field=value"):
        parse_overrides(["num_layers"])
