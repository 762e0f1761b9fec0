"""Tokenizers, the .bin/.idx files and batches through Megatron's GPTDataset."""

import json
import os

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_mvmoe.data.corpus import iter_texts
from megatron_mvmoe.data.indexed import read_meta
from megatron_mvmoe.data.loader import (DataConfig, PretrainingSampler, build_datasets,
                                        microbatches)
from megatron_mvmoe.data.preprocess import TOKENIZER_DIR
from megatron_mvmoe.data.sources import DOMAINS
from megatron_mvmoe.data.tokenize import gpt2_tokenizer, load_tokenizer

SEQ = 32


def test_gpt2_bpe_known_ids():
    tok = gpt2_tokenizer()
    assert tok.tokenize("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257 and tok.eod == 50256
    text = "The quick brown fox, 1234 — naïve café!"
    assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.metadata()["vocab_sha256"] == (
        "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")


def test_trained_bpe_round_trips_held_out_text(corpus_dir, data_dir):
    tok = load_tokenizer(os.path.join(data_dir, TOKENIZER_DIR), "bpe")
    assert tok.vocab_size == 512 and tok.eod == 0
    for domain in DOMAINS:
        text = next(iter_texts(corpus_dir, domain, "valid"))
        ids = tok.tokenize(text)
        assert max(ids) < tok.vocab_size and tok.eod not in ids
        assert tok.detokenize(ids) == text
        assert len(ids) < len(text.encode("utf-8"))  # merges were learned


def test_indexed_documents_are_the_corpus_documents(corpus_dir, data_dir):
    tok = load_tokenizer(os.path.join(data_dir, TOKENIZER_DIR), "bpe")
    for domain in DOMAINS:
        texts = list(iter_texts(corpus_dir, domain, "test"))
        dataset = IndexedDataset(os.path.join(data_dir, f"{domain}_test"))
        assert len(dataset) == len(texts)
        for i, text in enumerate(texts[:5]):
            ids = dataset[i].tolist()
            assert ids[-1] == tok.eod
            assert ids[:-1] == tok.tokenize(text)


def test_metadata_records_tokenizer_and_counts(data_dir):
    meta = read_meta(data_dir)
    assert meta["tokenizer"]["kind"] == "bpe" and meta["tokenizer"]["vocab_size"] == 512
    entry = meta["prefixes"]["books.train"]
    assert entry["bin_bytes"] == 2 * entry["tokens"]  # uint16 ids
    assert entry["dtype"] == "uint16"


@pytest.fixture(scope="module")
def bundle(data_dir):
    config = DataConfig(data_dir=data_dir, seq_length=SEQ, micro_batch_size=4,
                        global_batch_size=8, train_samples=64, seed=7)
    return build_datasets(config)


def _domain_stream(data_dir, domain, split):
    # Items are views into the dataset's mmap, which closes when the dataset is freed:
    # copy while it is alive.
    dataset = IndexedDataset(os.path.join(data_dir, f"{domain}_{split}"))
    return np.concatenate([np.array(dataset[i]) for i in range(len(dataset))])


def _contains(haystack, needle):
    windows = np.lib.stride_tricks.sliding_window_view(haystack, len(needle))
    return bool((windows == needle).all(axis=1).any())


def test_train_batches_are_spans_of_the_train_files(bundle, data_dir):
    batch = next(microbatches(bundle.train, 4))
    assert batch["tokens"].shape == (4, SEQ) and batch["tokens"].dtype == torch.int64
    assert batch["attention_mask"].shape == (4, 1, SEQ, SEQ)
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["position_ids"][0], torch.arange(SEQ))
    assert batch["loss_mask"].sum() == 4 * SEQ
    causal = ~torch.tril(torch.ones(SEQ, SEQ, dtype=torch.bool))
    assert torch.equal(batch["attention_mask"][0, 0], causal)  # True = masked
    for row, domain_id in zip(range(4), batch["dataset_id"].tolist()):
        domain = DOMAINS[domain_id]
        sample = np.concatenate([batch["tokens"][row].numpy(), batch["labels"][row, -1:]])
        assert _contains(_domain_stream(data_dir, domain, "train"), sample)


def test_batches_decode_to_corpus_text(bundle, corpus_dir):
    tok = bundle.tokenizer
    batch = next(microbatches(bundle.valid["tech"], 2))
    pieces = tok.detokenize(batch["tokens"][0]).split("<|endoftext|>")
    corpus = "\n".join(iter_texts(corpus_dir, "tech", "valid"))
    longest = max(pieces, key=len)
    assert len(longest) > 20 and longest in corpus


def test_per_domain_held_out_sets_are_full_epochs(bundle, data_dir):
    meta = read_meta(data_dir)
    for domain in DOMAINS:
        for split, datasets in (("valid", bundle.valid), ("test", bundle.test)):
            tokens = meta["prefixes"][f"{domain}.{split}"]["tokens"]
            assert len(datasets[domain]) == (tokens - 1) // SEQ


def test_train_blend_uses_every_domain(bundle):
    ids = [bundle.train[i]["dataset_id"] for i in range(len(bundle.train))]
    assert set(int(i) for i in ids) == {0, 1, 2}


def test_sampler_splits_each_block_across_data_parallel_ranks():
    ranks = [list(PretrainingSampler(20, 4, 2, r, 2)) for r in range(2)]
    assert ranks[0][:2] == [[4, 5], [8, 9]] and ranks[1][:2] == [[6, 7], [10, 11]]
    flat = sorted(i for r in ranks for b in r for i in b)
    assert flat == list(range(4, 20))


def _naive_wrapping_order(total, consumed, mbs, dp_rank, dp_size, steps):
    """Megatron's order written out: block k starts at consumed + k * mbs * dp_size, this
    rank reads its mbs ids of it, every id taken modulo the dataset size."""
    return [[(consumed + k * mbs * dp_size + dp_rank * mbs + i) % total for i in range(mbs)]
            for k in range(steps)]


def test_wrapping_sampler_continues_past_the_end_like_the_naive_order():
    for consumed, dp_rank in ((0, 0), (14, 1), (37, 0)):
        sampler = PretrainingSampler(10, consumed, 3, dp_rank, 2, wrap=True)
        got = [batch for batch, _ in zip(sampler, range(12))]
        assert got == _naive_wrapping_order(10, consumed, 3, dp_rank, 2, 12)
    with pytest.raises(TypeError, match="endless"):
        len(PretrainingSampler(10, 0, 3, 0, 2, wrap=True))
    # Without wrap the same sampler stops at the last full block.
    assert list(PretrainingSampler(10, 0, 3, 0, 1)) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_wrapping_microbatches_leave_the_global_random_stream_alone(bundle):
    state = torch.get_rng_state()
    batches = microbatches(bundle.valid["tech"], 2, wrap=True)
    first = [next(batches)["tokens"] for _ in range(len(bundle.valid["tech"]) // 2 + 1)]
    assert torch.equal(torch.get_rng_state(), state)  # a DataLoader draws a seed on iter()
    last_first_id = 2 * (len(first) - 1) % len(bundle.valid["tech"])  # past the end: wrapped
    assert torch.equal(first[-1][0], torch.as_tensor(bundle.valid["tech"][last_first_id]["tokens"]))


def test_preprocess_cli_json(corpus_dir, tmp_path, capsys, load_tool):
    main = load_tool("preprocess_data").main
    assert main(["--corpus", corpus_dir, "--out", str(tmp_path), "--tokenizer", "gpt2",
                 "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokenizer"]["eod_id"] == 50256
    assert summary["prefixes"]["tech.valid"]["tokens"] > 0


def test_collate_expands_a_shared_mask_and_stacks_distinct_ones():
    from megatron_mvmoe.data.loader import collate

    causal = torch.tril(torch.ones(1, 4, 4, dtype=torch.bool)) < 0.5
    same = [{"tokens": torch.arange(4), "attention_mask": causal.clone()} for _ in range(3)]
    batch = collate(same)
    assert batch["attention_mask"].shape == (3, 1, 4, 4)
    assert batch["attention_mask"].stride(0) == 0  # a view, not three copies
    assert torch.equal(batch["tokens"], torch.arange(4).expand(3, 4))
    other = causal.clone()
    other[0, 3, 0] = True
    batch = collate([same[0], {"tokens": torch.arange(4), "attention_mask": other}])
    assert torch.equal(batch["attention_mask"], torch.stack([causal, other]))


def test_train_microbatches_resume_where_they_stopped(bundle):
    from megatron_mvmoe.data.loader import num_microbatches, train_microbatches

    config = DataConfig(data_dir="unused", seq_length=SEQ, micro_batch_size=4,
                        global_batch_size=8, train_samples=64)
    assert num_microbatches(config, dp_size=1) == 2
    with pytest.raises(ValueError, match="not a multiple of micro_batch_size"):
        num_microbatches(config, dp_size=3)
    full = train_microbatches(bundle, config)
    steps = [[next(full)["tokens"] for _ in range(2)] for _ in range(3)]
    resumed = train_microbatches(bundle, config, consumed_samples=2 * 8)
    assert torch.equal(next(resumed)["tokens"], steps[2][0])
