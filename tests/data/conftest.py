"""Session fixtures: one tiny real corpus and one tokenized copy, shared by the data tests.

The corpus is the real sources capped at a few hundred KB per domain; the BPE is small
(512 tokens) so training and tokenizing take about a second.
"""

import importlib.util
import os
import warnings

import pytest

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from megatron_mvmoe.data.corpus import CorpusConfig, build_corpus  # noqa: E402
from megatron_mvmoe.data.preprocess import PreprocessConfig, preprocess  # noqa: E402
from megatron_mvmoe.data.sources import SourcePaths  # noqa: E402

TINY_MB_PER_DOMAIN = 0.15
TINY_VOCAB = 512


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("corpus"))
    build_corpus(CorpusConfig(out_dir=out, paths=SourcePaths(),
                              max_mb_per_domain=TINY_MB_PER_DOMAIN))
    return out


@pytest.fixture(scope="session")
def data_dir(corpus_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tok"))
    preprocess(PreprocessConfig(corpus_dir=corpus_dir, out_dir=out, tokenizer="bpe",
                                vocab_size=TINY_VOCAB))
    return out


@pytest.fixture(scope="session")
def load_tool():
    """Import tools/<name>.py by path (tools/ is not a package)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def load(name):
        path = os.path.join(root, "tools", name + ".py")
        spec = importlib.util.spec_from_file_location(f"_tool_{name}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
