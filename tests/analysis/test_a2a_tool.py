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
    assert out["ratios_with_bookkeeping"]["ep2/alltoall/multi_view"] == 1.0
    for entry in out["results"]:
        assert entry["checks"] and all(c["ok"] for c in entry["checks"])


def test_a2a_volume_reaches_views_mode_counted_equals_analytic(capsys):
    """The routing-shape flags reach the dedup dispatcher's views mode (n >= 3 experts of a
    token on one destination) at EP 2 and 4, rank and node semantics, and every byte,
    bookkeeping included, is counted == analytic per rank, phase, payload and link."""
    import a2a_volume

    code = a2a_volume.main(["--ep", "2", "4", "--variants", "multi_view", "--dispatchers",
                            "alltoall", "--semantics", "rank", "node", "--num-experts", "16",
                            "--topk", "6", "--brief", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["all_exact"]
    assert {(e["ep"], e["semantics"]) for e in out["results"]} == {
        (2, "rank"), (2, "node"), (4, "rank"), (4, "node")}
    for entry in out["results"]:
        assert entry["checks_total"] > 0 and entry["checks_exact"] == entry["checks_total"]
        assert entry["views_pairs"] > 0, (entry["ep"], entry["semantics"])
        first = entry["link_bytes_mean"][sorted(entry["link_bytes_mean"])[0]]
        assert first["self_bookkeeping"] > 0 and first["intra"] + first["inter"] > 0
    assert a2a_volume.main(["--num-experts", "4", "--topk", "6"]) == 2
    assert "--topk 6" in capsys.readouterr().err


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
