"""Megatron-LM users' data: `.bin/.idx` prefixes written by Megatron-Core's own
IndexedDatasetBuilder, blended by weights with `--data-path W A W B --split`, train and
evaluate per component (names from the data); per-split paths, mock data and tokenizers
selected by --tokenizer-type."""

import pytest

from harness import train
from textdata import build_megatron_prefixes

from megatron_mvmoe.config.flags import config_from_args
from megatron_mvmoe.config.run_config import DataSection

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    return build_megatron_prefixes(str(tmp_path_factory.mktemp("megatron_data")))


def _argv(prefixes, *data):
    return ["--model-preset", "tiny_smoe", "--seq-length", "32", "--train-iters", "10",
            "--global-batch-size", "8", "--micro-batch-size", "2", "--eval-iters", "2",
            "--eval-interval", "0", "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-warmup-iters", "1", "--log-interval", "3", "--tensorboard", "false",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
            prefixes["tokenizer"], *data]


def _raw(argv):
    run = config_from_args(argv)
    run.model.vocab_size = None  # resolved from the tokenizer inside pretrain
    return run.to_dict()


def test_weighted_blend_trains_and_evaluates_per_component(prefixes, tmp_path):
    argv = _argv(prefixes, "--data-path", "0.3", prefixes["tech"], "0.7",
                 prefixes["reference"], "--split", "90,10,0",
                 "--data-cache-path", str(tmp_path / "cache"))
    out = train(_raw(argv), 1)
    assert set(out["eval"]) == {"tech_text_document", "reference_text_document"}
    assert out["losses"][-1] < out["losses"][0] - 0.2, out["losses"]
    assert any((tmp_path / "cache").iterdir())  # Megatron's index cache went there


def test_blend_draws_by_weight_and_components_keep_their_split(prefixes, tmp_path):
    from megatron_mvmoe.data.megatron_blend import build_megatron_datasets
    from megatron_mvmoe.data.tokenizers import build_tokenizer

    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=prefixes["tokenizer"])
    spec = DataSection(path=["0.3", prefixes["tech"], "0.7", prefixes["reference"]],
                       split="90,10,0", cache_path=str(tmp_path))
    data = build_megatron_datasets(spec, tok, 32, 1234, train_samples=400, eval_samples=8,
                                   vocab_size=512)
    ids = [int(data.train[i]["dataset_id"]) for i in range(400)]
    assert abs(ids.count(0) / 400 - 0.3) < 0.02  # Megatron's BlendedDataset, by weight
    tech = data.valid["tech_text_document"]
    # The component's valid split starts where the blend's train split of that prefix ends.
    blend_tech_train = data.train.datasets[0]
    assert blend_tech_train.indices.max() < tech.indices.min() and len(tech) >= 8


def test_vocab_is_tokenizer_padded_like_megatron(prefixes):
    from megatron_mvmoe.data.run_data import resolve_tokenizer

    for divisible, tp, expected in ((128, 1, 512), (100, 1, 600), (128, 2, 512), (7, 2, 518)):
        run = config_from_args(_argv(prefixes, "--data-path", prefixes["tech"],
                                     "--make-vocab-size-divisible-by", str(divisible),
                                     "--tensor-model-parallel-size", str(tp)))
        run.model.vocab_size = None
        resolve_tokenizer(run)
        assert run.model.vocab_size == expected, (divisible, tp)


def test_per_split_paths_evaluate_each_valid_prefix(prefixes):
    argv = _argv(prefixes, "--train-data-path", prefixes["tech"], prefixes["reference"],
                 "--valid-data-path", prefixes["reference"], prefixes["tech"])
    out = train(_raw(argv), 1)
    assert list(out["eval"]) == ["reference_text_document", "tech_text_document"]


def test_mock_data_with_null_tokenizer():
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
            "--ffn-hidden-size", "64", "--num-experts", "2", "--moe-router-topk", "2",
            "--seq-length", "16", "--train-iters", "2", "--global-batch-size", "4",
            "--micro-batch-size", "2", "--eval-iters", "1", "--tensorboard", "false",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
            # Megatron-LM's architecture defaults (GeLU/LayerNorm/learned/tied) made explicit
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--untie-embeddings-and-output-weights", "--disable-bias-linear"]
    run = config_from_args(argv)
    out = train(run.to_dict(), 1)
    assert list(out["eval"]) == ["mock"] and len(out["losses"]) == 2


def test_bad_blends_fail_with_the_fix(prefixes):
    from megatron_mvmoe.data.megatron_blend import check_sources

    with pytest.raises(ValueError, match="--data-path: .* mixes weights"):
        check_sources(DataSection(path=["0.5", prefixes["tech"], prefixes["reference"]]))
    with pytest.raises(ValueError, match="exactly one"):
        check_sources(DataSection(path=[prefixes["tech"]], mock=True))
    with pytest.raises(ValueError, match="--split applies"):
        check_sources(DataSection(train_path=[prefixes["tech"]], split="1,0,0"))


def test_dali_loader_gives_the_torch_loaders_losses(prefixes):
    pytest.importorskip("nvidia.dali")
    argv = _argv(prefixes, "--data-path", prefixes["tech"], prefixes["reference"],
                 "--split", "90,10,0", "--train-iters", "4", "--eval-iters", "0")
    torch_run = train(_raw(argv), 1)
    dali_run = train(_raw(argv + ["--data-loader", "dali"]), 1)
    assert len(dali_run["losses"]) == 4 and dali_run["losses"] == torch_run["losses"]


def test_padded_vocab_size_is_the_model_vocabulary():
    """Megatron-LM's --padded-vocab-size (the GPT-OSS corpus line): the model's rows
    exactly, not the tokenizer's vocabulary padded by --make-vocab-size-divisible-by; one
    error naming the flag when a token id would have no row."""
    from megatron_mvmoe.data.run_data import resolve_tokenizer

    line = ["--model-preset", "tiny_dense", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "512",
            "--make-vocab-size-divisible-by", "128"]
    for extra, expected in (([], 640), (["--padded-vocab-size", "1000"], 1000)):
        run = config_from_args(line + extra)
        resolve_tokenizer(run)
        assert run.model.vocab_size == expected, extra
    run = config_from_args(line + ["--padded-vocab-size", "500"])
    with pytest.raises(ValueError, match=r"--padded-vocab-size\): 500 must be at least the "
                                         r"tokenizer's vocabulary 513"):
        resolve_tokenizer(run)
