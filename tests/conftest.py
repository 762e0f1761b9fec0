"""Shared pytest set-up: one thread per process (the machine has 2 cores shared by
many processes), the GPU marker, and the tiny real-text token set every training test
trains on (`text_tokens`, built once per session)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

if not torch.cuda.is_available():
    # Triton's standard-library functions (tl.sigmoid, ...) are jit-decorated when
    # triton.language is first imported, in the mode the environment says then. Megatron
    # may import Triton before any kernel test module runs, so without a GPU the whole
    # session uses the interpreter (compiled Triton cannot run here anyway).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def text_tokens(tmp_path_factory):
    """tests/training/textdata.py's two-domain token set (512-token BPE), shared read-only by
    every test that trains; ~2 s to build."""
    from textdata import build_token_dir

    return build_token_dir(str(tmp_path_factory.mktemp("tokens")))


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/assets/losses/<platform>/*.txt from this run")
    parser.addoption("--golden-reason", default=None,
                     help="why the golden losses change (required with --update-golden)")


def pytest_configure(config):
    if config.getoption("--update-golden") and not config.getoption("--golden-reason"):
        raise pytest.UsageError("--update-golden needs --golden-reason \"what changed\"")
    config.addinivalue_line("markers", "gpu: needs CUDA; skipped without it")
    config.addinivalue_line("markers", "slow: longer functional runs")
    config.addinivalue_line("markers", "launchers: needs mpirun / slurm installed")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
