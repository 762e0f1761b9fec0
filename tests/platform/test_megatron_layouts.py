"""`tools/megatron_moe_tests.py --ranks auto`: the rank counts a Megatron test file's layouts
need, read from its source (no test run), and the per-file best over those counts."""

import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest

from megatron_mvmoe.testing import megatron_suite as suite
from megatron_mvmoe.testing.megatron_layouts import rank_counts, world_size_needed

ROOT = Path(__file__).resolve().parents[2]
MIRROR = "/work/.mirror/NVIDIA+Megatron-LM/repo"

LAYOUT_FORMS = '''
import pytest
from tests.unit_tests.test_utilities import Utils


class TestTuples:
    @pytest.mark.parametrize("num_moe_experts", [8])
    @pytest.mark.parametrize("tp_size,ep_size", [(1, 1), (2, 2)])
    def test_a(self, num_moe_experts, tp_size, ep_size):
        Utils.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                        expert_model_parallel_size=ep_size)


@pytest.mark.parametrize(("tp_ep", "swiglu"), [pytest.param((1, 2), True)])
def test_compound_name(tp_ep, swiglu):
    pass


def test_literal_call():
    Utils.initialize_model_parallel(1, 1, expert_model_parallel_size=8)
'''


def test_layouts_in_every_form_megatron_writes_them():
    # tp 2 x ep 2 -> 4 (TestTuples), tp_ep (1, 2) -> 2, a literal ep 8 -> 8; always 1
    assert rank_counts(LAYOUT_FORMS) == [1, 2, 4, 8]
    assert rank_counts("def test_plain():\n    pass\n") == [1]


def test_a_keyword_bound_to_a_parametrized_name_gives_that_name_its_dimension():
    # Megatron's test_seq_aux_loss passes ep_size as expert_tensor_parallel_size: the layout
    # (tp 2, etp 4) needs lcm(2, 4) = 4 ranks, not the 8 of tp 2 x ep 4
    source = '''
import pytest
@pytest.mark.parametrize("tp_size,ep_size", [(2, 4)])
def test_seq(tp_size, ep_size):
    Utils.initialize_model_parallel(tensor_model_parallel_size=tp_size,
                                    expert_tensor_parallel_size=ep_size)
'''
    assert rank_counts(source) == [1, 4]


def test_world_size_needed_is_the_lcm_of_the_dense_and_expert_groups():
    assert world_size_needed({"tp": 4, "ep": 2}) == 8  # expert tp defaults to tp
    assert world_size_needed({"tp": 2, "cp": 2, "ep": 2}) == 4
    assert world_size_needed({"tp": 1, "ep": 8, "etp": 1}) == 8
    assert world_size_needed({"tp": 2, "pp": 2, "cp": 2}) == 8
    assert world_size_needed({}) == 1


def _core_file(name):
    return subprocess.run(["git", "--git-dir", MIRROR, "show",
                           f"{suite.DEFAULT_REF}:{suite.MOE_TESTS}/{name}"],
                          capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(not os.path.isdir(MIRROR), reason="no Megatron-LM git directory here")
@pytest.mark.parametrize("name,counts", [
    ("test_a2a_token_dispatcher.py", [1, 8]),
    ("test_aux_loss.py", [1, 4, 8]),
    ("test_moe_layer.py", [1, 4, 8]),
    ("test_moe_layer_discrepancy.py", [1, 2, 4, 8]),
    ("test_routers.py", [1, 8]),
    ("test_sequential_mlp.py", [1, 4]),
    ("test_shared_experts.py", [1, 4, 8]),
    ("test_token_dispatcher.py", [1, 8]),
    ("test_upcycling.py", [1, 2]),
    ("test_multihot_indices_converter.py", [1]),
    ("test_router_replay.py", [1]),
])
def test_rank_counts_of_megatron_core_r0_19_0_files(name, counts):
    """The layouts Megatron's CI runs these files with (8 GPUs), as the parser reads them."""
    assert rank_counts(_core_file(name)) == counts


@pytest.fixture
def tool():
    spec = importlib.util.spec_from_file_location("_tool_megatron_moe_tests",
                                                  ROOT / "tools" / "megatron_moe_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def checkout(tmp_path):
    """A Megatron-LM work tree with a 1-rank file and a file whose layouts need 2 and 4."""
    for rel in suite._NEEDED_PATHS:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        if not rel.endswith(".py"):
            (tmp_path / rel).mkdir(exist_ok=True)
        else:
            (tmp_path / rel).write_text("")
    moe = tmp_path / suite.MOE_TESTS
    moe.mkdir(parents=True)
    (moe / "test_single.py").write_text("def test_one():\n    pass\n")
    (moe / "test_layouts.py").write_text(
        "import pytest\n@pytest.mark.parametrize('tp_size,ep_size', [(1, 2), (2, 2)])\n"
        "def test_l(tp_size, ep_size):\n    pass\n")
    return tmp_path


def test_auto_runs_each_file_at_its_counts_and_reports_the_best(tool, checkout, monkeypatch,
                                                                capsys):
    sessions = []
    outcome = {("test_single.py", 1): (1, 0, 0), ("test_layouts.py", 1): (0, 2, 0),
               ("test_layouts.py", 2): (1, 1, 0), ("test_layouts.py", 4): (2, 0, 0)}

    def fake_run_files(tests_dir, files, world_size, **_):
        sessions.append(([os.path.basename(f) for f in files], world_size))
        return [suite.FileResult(f, world_size, *outcome[(os.path.basename(f), world_size)])
                for f in files]

    monkeypatch.setattr(tool.suite, "run_files", fake_run_files)
    args = ["--megatron-lm-src", str(checkout), "--ref", "worktree", "--isolate-files"]
    assert tool.main(args + ["--json"]) == 0
    assert sessions == [(["test_layouts.py"], 1), (["test_single.py"], 1),
                        (["test_layouts.py"], 2), (["test_layouts.py"], 4)]
    report = json.loads(capsys.readouterr().out)
    assert report["ranks"] == "auto"
    assert report["rank_counts"] == {"test_layouts.py": [1, 2, 4], "test_single.py": [1]}
    assert report["best"]["test_layouts.py"] == dict(world_size=4, passed=2, failed=0,
                                                     skipped=0)
    assert report["best_totals"] == {"passed": 3, "failed": 0, "skipped": 0}
    assert tool.main(args) == 0  # the markdown table: a count a file does not need is "-"
    table = capsys.readouterr().out
    assert "| test_single.py | 1/0/0 | - | - | 1/0/0 at 1 |" in table
    assert "total, best per file: 3 passed, 0 failed, 0 skipped" in table
    sessions.clear()
    outcome[("test_single.py", 2)] = (1, 0, 0)
    assert tool.main(args + ["--ranks", "2", "1", "--json"]) == 0  # given counts: every file
    assert sorted(sessions, key=str) == sorted([(["test_layouts.py"], 1), (["test_single.py"], 1),
                                                (["test_layouts.py"], 2),
                                                (["test_single.py"], 2)], key=str)


def test_ranks_must_be_auto_alone_or_counts(tool, capsys):
    for bad in (["auto", "2"], ["0"], ["two"]):
        with pytest.raises(SystemExit) as exit_:
            tool.parse_args(["--megatron-lm-src", "x", "--ranks", *bad])
        assert exit_.value.code == 2
        assert f"error: --ranks {' '.join(bad)}:" in capsys.readouterr().err
