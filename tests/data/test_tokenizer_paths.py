"""Every way a trained run's tokenizer is rebuilt for evaluation tokenizes exactly as the
tokenizer that wrote its training data (tools/preprocess_data.py's tokenizer/; the .bin
documents are its ids, test_indexed_documents_are_the_corpus_documents):

- tools/lm_eval_run.py (toolkit/checkpoint.run_tokenizer) with the run's data.path, with
  --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt, and with
  --tokenizer-type HuggingFaceTokenizer --tokenizer-model <tokenizer/>;
- lm-eval's hf backend on a tools/export_hf.py export (AutoTokenizer over the exported
  tokenizer.json, encoded as lm-eval's HFLM.tok_encode does: no special tokens added);
- GPT-2's own BPE algorithm on the same two files (transformers' pure-Python GPT2Tokenizer,
  the algorithm of Megatron-LM's GPT2BPETokenizer), the reference none of them shares code with.
"""

import os

import pytest

from megatron_mvmoe.config.run_config import config_from_dict
from megatron_mvmoe.data.corpus import iter_texts
from megatron_mvmoe.data.preprocess import TOKENIZER_DIR
from megatron_mvmoe.data.sources import DOMAINS
from megatron_mvmoe.data.tokenize import EOD_TOKEN, MERGES_FILE, VOCAB_FILE, load_tokenizer
from megatron_mvmoe.toolkit.checkpoint import run_tokenizer

# Whitespace runs (spaces, tabs, blank lines, CRLF, no-break and em spaces), contractions,
# digits in several shapes, accents, CJK, Greek, Cyrillic, emoji with a skin-tone modifier,
# punctuation runs, markup, and the end-of-document token's text inside a document.
VARIED_TEXT = (
    "The quick brown fox   jumps\tover 13 lazy dogs.\n\n\nDon't we'll they've I'm OK. "
    "café naïve résumé — “smart quotes” and ‘single’… 東京タワー Ελληνικά Русский 🙂👍🏽 "
    "3.14159, 1,000,000 and 2026-12-06T16:45Z; x=y+2*(z-1)   \n  \t indented line   "
    "trailing spaces    \r\nwindows line\u00a0nbsp\u2003em-space ?!... <b>html</b> "
    f"e-mail: a.b@c.org #tag @user $5.00 100% ~~~ 0x1F 007{EOD_TOKEN}next document  ")


@pytest.fixture(scope="module")
def texts(corpus_dir):
    # 2000 characters of each domain's first held-out document: real text, kept short for
    # the pure-Python reference
    held_out = [next(iter_texts(corpus_dir, domain, "test"))[:2000] for domain in DOMAINS]
    return [VARIED_TEXT, *held_out]


def _lm_eval_run_tokenizers(data_dir):
    """What lm_eval_run.py builds: the run's tokenizer, or the one its flags name."""
    tok_dir = os.path.join(data_dir, TOKENIZER_DIR)
    flags = {
        "the run's data.path": {},
        "--tokenizer-type GPT2BPETokenizer": {
            "tokenizer_type": "GPT2BPETokenizer",
            "vocab_file": os.path.join(tok_dir, VOCAB_FILE),
            "merge_file": os.path.join(tok_dir, MERGES_FILE)},
        "--tokenizer-type HuggingFaceTokenizer": {
            "tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": tok_dir},
    }
    return {name: run_tokenizer(config_from_dict({"data": {"path": data_dir, **data}})).tokenize
            for name, data in flags.items()}


def _exported_for_lm_eval_hf(own, out_dir):
    from transformers import AutoTokenizer

    from megatron_mvmoe.hf.writer import write_tokenizer

    assert write_tokenizer(out_dir, own, EOD_TOKEN)
    hf = AutoTokenizer.from_pretrained(out_dir)
    return lambda text: hf.encode(text, add_special_tokens=False)


def _gpt2_reference(tok_dir):
    from transformers import GPT2Tokenizer

    # GPT-2's encoder (and Megatron-LM's GPT2BPETokenizer) has no special tokens in encode:
    # split_special_tokens keeps transformers' added-token matching out of the algorithm
    slow = GPT2Tokenizer(os.path.join(tok_dir, VOCAB_FILE), os.path.join(tok_dir, MERGES_FILE),
                         split_special_tokens=True)
    return lambda text: slow.encode(text, add_special_tokens=False)


def test_every_evaluation_path_tokenizes_as_the_training_data_was(data_dir, texts, tmp_path):
    tok_dir = os.path.join(data_dir, TOKENIZER_DIR)
    own = load_tokenizer(tok_dir, "bpe")
    paths = {**_lm_eval_run_tokenizers(data_dir),
             "lm-eval hf backend on the export": _exported_for_lm_eval_hf(own, str(tmp_path)),
             "GPT-2 BPE reference": _gpt2_reference(tok_dir)}
    for text in texts:
        want = own.tokenize(text)
        assert own.detokenize(want) == text
        for name, tokenize in paths.items():
            assert tokenize(text) == want, f"{name} tokenizes {text[:40]!r}... differently"
    # A literal <|endoftext|> in a document is text, as preprocessing wrote it: the EOD id
    # only ever separates documents.
    assert own.eod not in own.tokenize(VARIED_TEXT) and EOD_TOKEN in VARIED_TEXT


def test_export_keeps_a_tokenizer_json_runs_special_token(data_dir, tmp_path):
    """A run on a tokenizer.json that declares <|endoftext|> special (Megatron-LM-style data,
    --tokenizer-type HuggingFaceTokenizer) read that text as the EOD id: its export must too."""
    from tokenizers import ByteLevelBPETokenizer

    from megatron_mvmoe.data.tokenizers import JsonTokenizer

    tok_dir = os.path.join(data_dir, TOKENIZER_DIR)
    bpe = ByteLevelBPETokenizer(os.path.join(tok_dir, VOCAB_FILE),
                                os.path.join(tok_dir, MERGES_FILE))
    bpe.add_special_tokens([EOD_TOKEN])
    bpe.save(str(tmp_path / "tokenizer.json"))
    run_tok = JsonTokenizer(str(tmp_path / "tokenizer.json"))
    want = run_tok.tokenize(VARIED_TEXT)
    assert run_tok.eod in want
    (tmp_path / "export").mkdir()
    exported = _exported_for_lm_eval_hf(run_tok, str(tmp_path / "export"))
    assert exported(VARIED_TEXT) == want


# (context, continuation) as lm-eval tasks hand them over: a context ending in whitespace, a
# word split across the join, and the usual leading-space continuation
PAIRS = [("Question: what is two plus two? Answer: ", "four"),
         ("The cat sat on the", " mat."),
         ("He said hel", "lo there"),
         ("Line one\n\n", "Line two"),
         ("tabs\t", "\tand spaces  ")]


def test_lm_eval_pairs_context_and_continuation_as_its_hf_backend(data_dir):
    """MVMoELM is lm-eval's TemplateLM: its loglikelihood requests get the (context,
    continuation) ids lm-eval gives its hf backend (trailing whitespace moved to the
    continuation, the whole text encoded and split after the context's ids), not two
    separate encodings, which differ wherever a token spans the join."""
    from lm_eval.api.model import TemplateLM

    from megatron_mvmoe.evaluation.lm_eval_model import MVMoELM

    lm = object.__new__(MVMoELM)  # the pairing needs the run's tokenizer, not a checkpoint
    lm.tokenizer = run_tokenizer(config_from_dict({"data": {"path": data_dir}}))
    assert MVMoELM.loglikelihood is TemplateLM.loglikelihood
    tokenize = lm.tokenizer.tokenize
    separately_differs = False
    for context, continuation in PAIRS:
        context_ids, continuation_ids = lm._encode_pair(context, continuation)
        stripped = context.rstrip()
        whole = tokenize(context + continuation)
        assert context_ids == tokenize(stripped), context
        assert continuation_ids == whole[len(context_ids):], (context, continuation)
        separately_differs |= (tokenize(context), tokenize(continuation)) != (
            context_ids, continuation_ids)
    assert separately_differs  # PAIRS hold a case the old pairing got wrong
