"""tools/a2a_volume.py at EP=2 on the full tiny GPT: counted == analytic, Multi-View = latent."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))


def test_a2a_volume_ep2_exact(capsys):
    import a2a_volume

    code = a2a_volume.main(["--ep", "2", "--variants", "latent", "multi_view",
                            "--dispatchers", "alltoall", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["all_exact"]
    assert out["ratios"]["ep2/alltoall/multi_view"] == 1.0
    for entry in out["results"]:
        assert entry["checks"] and all(c["ok"] for c in entry["checks"])
