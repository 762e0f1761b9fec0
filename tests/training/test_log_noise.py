"""A clean normal run's log (issue 26): the filters of megatron_mvmoe/log_noise.py each hide
only their own message from their own source, and a short real training run under torchrun
(EP = 2, a save, then a resume with an async save) prints no Python warning, none of the
filtered messages and no "Overwriting old incomplete / corrupted checkpoint..." (the trainer
used to trigger that on every save)."""

import logging
import os
import re
import subprocess
import sys
import warnings

import pytest

from megatron_mvmoe import log_noise

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _shown_warnings(message, category, module):
    """Messages of `warnings.warn_explicit` that reach the user with only our filters (and
    Python's show-everything default) in place."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()  # drop pytest's ignore::UserWarning for this check
        warnings.simplefilter("always")
        log_noise.install()
        warnings.warn_explicit(message, category, "x.py", 1, module=module)
    return [str(w.message) for w in seen]


@pytest.mark.parametrize("noise", log_noise.WARNINGS, ids=lambda n: n.name)
def test_each_warning_filter_hides_only_its_own_message(noise):
    module = noise.module + ".sub" if noise.module else "anywhere"
    assert _shown_warnings(noise.example, noise.category, module) == []
    other = "something else happened"
    assert _shown_warnings(other, noise.category, module) == [other]
    if noise.module:  # the same text from someone else's module still shows
        assert _shown_warnings(noise.example, noise.category, "mypackage.mod") == [
            noise.example]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("noise", log_noise.LOG_RECORDS, ids=lambda n: n.name)
def test_each_log_filter_hides_only_its_own_message(noise):
    log_noise.install()
    log_noise.install()  # idempotent
    logger, sibling = logging.getLogger(noise.logger), logging.getLogger(noise.logger + "_x")
    assert sum(isinstance(f, log_noise._RecordFilter) for f in logger.filters) == 1
    records = _Records()
    for target in (logger, sibling):
        target.addHandler(records)
    try:
        logger.warning(noise.example)
        logger.warning("a real problem")
        sibling.warning(noise.example)
    finally:
        for target in (logger, sibling):
            target.removeHandler(records)
    assert records.messages == ["a real problem", noise.example]


_PY_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")
_TORCH_LOG = re.compile(r"^[WE]\d{4} \d\d:\d\d:\d\d")


def _noise_lines(text):
    return [line for line in text.splitlines()
            if _PY_WARNING.match(line) or _TORCH_LOG.match(line) or log_noise.hidden(line)
            or "Overwriting old incomplete" in line or "Traceback" in line]


def _train(tmp, data, *flags):
    from megatron_mvmoe.testing.spawn import free_port

    line = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-port", str(free_port()), "-m", "megatron_mvmoe.training.pretrain",
            "--model-preset", "tiny_multi_view", "--seq-length", "32",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-iters", "1",
            "--eval-interval", "0", "--expert-model-parallel-size", "2",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", data["tokenizer"],
            "--data-path", "0.5", data["tech"], "0.5", data["reference"], "--split", "90,10,0",
            "--save", os.path.join(tmp, "ck"), "--run-dir", os.path.join(tmp, "run"), *flags]
    # No PYTHONWARNINGS: the run's own filters are what is tested.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run(line, cwd=ROOT, env=dict(env, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow  # two torchrun launches, ~130 s on 2 busy cores
@pytest.mark.timeout(600)
def test_short_training_run_prints_no_noise(tmp_path):
    from textdata import build_megatron_prefixes

    data = build_megatron_prefixes(str(tmp_path / "data"))
    first = _train(str(tmp_path), data, "--train-iters", "2")
    assert "step      2/2" in first and "saved checkpoint" in first, first
    resumed = _train(str(tmp_path), data, "--train-iters", "3", "--load",
                     str(tmp_path / "ck"), "--async-save")
    assert "resumed from" in resumed and "saved checkpoint" in resumed, resumed
    assert _noise_lines(first + resumed) == [], first + resumed
