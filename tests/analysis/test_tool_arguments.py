"""The tools' wrong-argument paths (issue 26): each is one line on stderr naming the flag
to fix, and a non-zero exit status, before any rank is spawned or checkpoint read.

Each case below was reproduced first; what it printed before:
- lm_eval_run.py --task-source /missing: a raw FileNotFoundError traceback;
- a2a_volume.py --checkpoint x: ran the whole counted mode, ignoring it; with --scale a
  traceback from a spawned rank naming --model;
- evaluate.py --input-jsonl /missing: "Fix: pass --input FILE.jsonl" (no such flag here);
- a2a_volume.py --ep 3: ten identical refusals, exit status 0;
- generate.py --load nonexistent: "drop --load to start fresh" (a tool cannot);
- a2a_volume.py with a selection without the latent baseline: "ratio ...: " and nothing.
"""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    return lines[0]


def _exit_of(main, argv, capsys):
    """(exit status, the one error line) of a tool's main(argv)."""
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's error path
        code = stop.code
    return code, _one_line_error(capsys.readouterr().err)


def test_lm_eval_missing_task_source(capsys):
    import lm_eval_run

    code, line = _exit_of(lm_eval_run.main, ["--load", "/tmp", "--task-source", "/missing"],
                          capsys)
    assert code == 2 and "--task-source" in line and "'/missing': no such file" in line


def test_evaluate_missing_input_jsonl_names_its_own_flag(capsys):
    import evaluate

    code, line = _exit_of(evaluate.main, ["--load", "/tmp", "--input-jsonl", "/missing"],
                          capsys)
    assert code == 2 and "--input-jsonl" in line and "--input " not in line


def test_a2a_checkpoint_flag_outside_scale_mode_is_refused(capsys):
    import a2a_volume

    code, line = _exit_of(a2a_volume.main, ["--checkpoint", "x"], capsys)
    assert code == 2 and "--checkpoint" in line and "--scale" in line
    assert "--model" not in line


def test_a2a_scale_checkpoint_that_is_not_one(capsys, tmp_path):
    import a2a_volume

    for path in ("x", str(tmp_path)):
        code, line = _exit_of(a2a_volume.main, ["--scale", "--routing", "checkpoint",
                                                "--checkpoint", path], capsys)
        assert code == 2 and f"--checkpoint {path}: no checkpoint here" in line
        assert "--model" not in line and "drop --load" not in line
    code, line = _exit_of(a2a_volume.main, ["--scale", "--checkpoint", str(tmp_path)], capsys)
    assert code == 2 and "--routing checkpoint" in line


def test_a2a_ep_that_does_not_divide_the_experts(capsys):
    import a2a_volume

    code, line = _exit_of(a2a_volume.main, ["--ep", "2", "3"], capsys)
    assert code == 2 and line.startswith("error: --ep 3:") and "[1, 2, 4]" in line


def test_a2a_selection_that_measures_nothing(capsys):
    import a2a_volume

    code, line = _exit_of(a2a_volume.main, ["--semantics", "rank", "--dispatchers",
                                            "allgather"], capsys)
    assert code == 2 and "--semantics rank" in line and "alltoall" in line
    code, line = _exit_of(a2a_volume.main, ["--semantics"], capsys)  # no usage dump
    assert code == 2 and "--semantics" in line


def test_a2a_ratio_line_says_why_it_is_empty(capsys):
    import a2a_volume

    code = a2a_volume.main(["--ep", "2", "--variants", "multi_view", "--dispatchers",
                            "alltoall", "--seq-length", "8", "--batch-size", "1"])
    out = capsys.readouterr().out
    ratio = [line for line in out.splitlines() if line.startswith("ratio to latent")]
    assert code == 0 and len(ratio) == 1
    assert "none: a ratio needs the latent baseline" in ratio[0], out


@pytest.mark.timeout(120)
def test_generate_missing_checkpoint_end_to_end():
    proc = subprocess.run([sys.executable, "tools/generate.py", "--load", "nonexistent",
                           "--prompt", "hi", "--json"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=100)
    line = _one_line_error(proc.stderr)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "--load nonexistent: no checkpoint here" in line and "iter_*" in line
    assert "start fresh" not in line
