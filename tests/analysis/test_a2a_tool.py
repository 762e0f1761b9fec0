"""tools/a2a_volume.py at EP=2 on the full tiny GPT: counted == analytic, Multi-View = latent."""
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a2a_volume_ep2_exact(capsys):
    import a2a_volume

    code = a2a_volume.main(["--ep", "2", "--variants", "latent", "multi_view",
                            "--dispatchers", "alltoall", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["all_exact"]
    assert out["ratios"]["ep2/alltoall/multi_view"] == 1.0
    for entry in out["results"]:
        assert entry["checks"] and all(c["ok"] for c in entry["checks"])


def test_a2a_volume_dedup_semantics_exact(capsys):
    import a2a_volume

    code = a2a_volume.main(["--ep", "2", "--variants", "multi_view", "--dispatchers",
                            "alltoall", "--semantics", "rank", "node", "--brief", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["all_exact"]
    for entry in out["results"]:
        assert entry["checks_total"] > 0 and entry["checks_exact"] == entry["checks_total"]
        assert entry["link_bytes_mean"]


def test_a2a_volume_scale_table_page_and_errors(capsys, tmp_path):
    import a2a_volume

    page, plot = tmp_path / "page.md", tmp_path / "plot.png"
    code = a2a_volume.main(["--scale", "--gpus", "8", "--routing", "balanced", "--markdown",
                            str(page), "--plot", str(plot), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and plot.stat().st_size > 0
    rows = out["runs"][0]["rows"]
    by = {(r["semantics"], r["variant"]): r for r in rows}
    assert by[("row", "multi_view")]["bytes_ratio"] == 1.0  # per-(token, expert) rows
    assert by[("rank", "multi_view")]["bytes_ratio"] > 1.0  # blends do not dedup for free
    assert by[("rank", "baseline")]["layer_a2a_ms"] < by[("row", "baseline")]["layer_a2a_ms"]
    text = page.read_text()
    assert "Multi-View costs MORE" in text and out["command"] in text
    assert a2a_volume.main(["--scale", "--routing", "checkpoint"]) == 2
    assert "--checkpoint" in capsys.readouterr().err
