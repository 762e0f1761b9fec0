"""`--train-iters 0` is Megatron-LM's evaluate-only run (issue 25 finding 7): on the
indexed data of tools/preprocess_data.py it failed with `train_samples=0: must be > 0`;
it now evaluates the initial model and saves it (a weights-only step-0 checkpoint)."""

import os

import pytest

from harness import tiny_run, train

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def indexed_dir(tmp_path_factory):
    from megatron_mvmoe.data.corpus import CorpusConfig, build_corpus
    from megatron_mvmoe.data.preprocess import PreprocessConfig, preprocess
    from megatron_mvmoe.data.sources import SourcePaths

    corpus = str(tmp_path_factory.mktemp("corpus"))
    out = str(tmp_path_factory.mktemp("indexed"))
    build_corpus(CorpusConfig(out_dir=corpus, paths=SourcePaths(), max_mb_per_domain=0.15))
    preprocess(PreprocessConfig(corpus_dir=corpus, out_dir=out, tokenizer="bpe",
                                vocab_size=512))
    return out


def test_train_iters_0_evaluates_and_saves_the_initial_model(indexed_dir, tmp_path):
    root = str(tmp_path / "ck")
    raw = tiny_run(indexed_dir, preset="tiny_latent", train_iters=0, eval_iters=1, save=root)
    raw["data"] = dict(kind="indexed", path=indexed_dir)
    out = train(raw, 1)
    assert out["losses"] == [] and out["eval"], out
    assert all(5.0 < loss < 7.0 for loss in out["eval"].values()), out["eval"]  # ~ln(512)
    with open(os.path.join(root, "latest")) as fh:
        assert fh.read().strip() == "iter_0000000"
    # ... and a run continues from it, as from any checkpoint.
    more = train(dict(raw, training=dict(raw["training"], train_iters=3, load=root,
                                         save=None)), 1)
    assert more["first_step"] == 1 and len(more["losses"]) == 3
