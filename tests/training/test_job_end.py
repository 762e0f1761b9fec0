"""The job-end summary line (training/job_end.py) from hand-written rank records
(training/rank_reports.py's format): which node or rank fell silent, the first error, and
the --load/--ckpt-step of the newest complete checkpoint."""

import json
from dataclasses import asdict

import yaml

from megatron_mvmoe.training.job_end import save_from_args, verdict
from megatron_mvmoe.training.rank_reports import REPORTS_DIR, RankReport


def _records(save, run, rows):
    (save / REPORTS_DIR).mkdir(parents=True)
    for rank, host, error, failed_at in rows:
        report = RankReport(rank, 4, host, 100 + rank, run, 0.0, error, failed_at)
        (save / REPORTS_DIR / f"rank_{rank:05d}.json").write_text(json.dumps(asdict(report)))


def _checkpoint(save, step, complete=True):
    directory = save / f"iter_{step:07d}"
    directory.mkdir(parents=True)
    if complete:
        (directory / "run_state.json").write_text("{}")
    (save / "latest").write_text(directory.name + "\n")


def test_a_lost_node_comes_first_then_the_first_error_and_where_to_resume(tmp_path):
    save = tmp_path / "ck"
    _records(save, "9.0", [(0, "n1", "RuntimeError: peer closed", 6.0),
                           (1, "n1", "RuntimeError: timed out", 5.0),
                           (2, "n2", None, None), (3, "n2", None, None)])
    _checkpoint(save, 8)
    line = verdict(1, str(save), "9.0")["line"]
    assert line == (
        "job failed (exit status 1): node n2 lost (ranks 2,3, PID 102, 103) ended without an "
        "error (killed, or hung and killed by the launcher); then rank 1 on n1: RuntimeError: "
        "timed out (and 1 more rank(s) after it); resume from the last good checkpoint "
        f"{save}/iter_0000008: --load {save} --ckpt-step 8")


def test_one_silent_rank_on_a_shared_node_is_named_as_a_rank(tmp_path):
    save = tmp_path / "ck"
    _records(save, "9.0", [(0, "n1", "RuntimeError: x", 1.0), (1, "n1", None, None),
                           (2, "n2", "RuntimeError: y", 2.0), (3, "n2", "RuntimeError: z", 3.0)])
    _checkpoint(save, 4, complete=False)  # `latest` names a half-written save
    line = verdict(1, str(save), "9.0")["line"]
    assert line.startswith("job failed (exit status 1): rank 1 on n1 (PID 101) ended without")
    assert "then rank 0 on n1: RuntimeError: x (and 2 more" in line
    assert line.endswith(f"no checkpoint in {save} to resume from (rerun from the start)")


def test_records_of_another_run_are_not_this_runs(tmp_path):
    save = tmp_path / "ck"
    _records(save, "8.0", [(0, "n1", None, None)])
    assert "before training started" in verdict(2, str(save), "9.0")["line"]
    assert verdict(0, str(save), "9.0") == {"kind": "finished", "requeue": False, "line": ""}


def test_save_comes_from_the_flag_or_the_yaml(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"training": {"save": "/ck/from_yaml"}}))
    assert save_from_args(["--config", str(config)]) == "/ck/from_yaml"
    assert save_from_args(["--config", str(config), "--save", "/ck/flag"]) == "/ck/flag"
    assert save_from_args(["--save=/ck/eq"]) == "/ck/eq"
    assert save_from_args(["--lr", "1"]) is None


def test_an_error_record_killed_before_its_rename_still_counts(tmp_path):
    """A rank killed between writing its error record and renaming it over its start record
    (write_json_atomic: fsync, then rename) leaves both files. Seen in CI: the summary then
    listed rank 0 as silent AND as the first error ("ranks 0,1 ... ended without an error;
    then rank 0 ..."). One record per rank: the error, the newer of the two."""
    save = tmp_path / "ck"
    (save / REPORTS_DIR).mkdir(parents=True)
    for rank in (0, 1):
        start = RankReport(rank, 2, "vm", 100 + rank, "9.0", 0.0)
        (save / REPORTS_DIR / f"rank_{rank:05d}.json").write_text(json.dumps(asdict(start)))
    error = RankReport(0, 2, "vm", 100, "9.0", 0.0, "RuntimeError: Connection reset", 5.0)
    (save / REPORTS_DIR / "rank_00000.json.tmp").write_text(json.dumps(asdict(error)))
    for name in ("rank_00001.json.tmp",):  # a start record cut short by the kill
        (save / REPORTS_DIR / name).write_text('{"rank": 1, "wor')
    _checkpoint(save, 2)
    line = verdict(137, str(save), "9.0")["line"]
    assert line.startswith(
        "job failed (exit status 137): rank 1 on vm (PID 101) ended without an error (killed, "
        "or hung and killed by the launcher); then rank 0 on vm: RuntimeError: Connection "
        "reset; "), line
