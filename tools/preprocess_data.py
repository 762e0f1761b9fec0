#!/usr/bin/env python
"""Tokenize a corpus built by tools/build_corpus.py into Megatron .bin/.idx datasets,
one per domain and split. See megatron_mvmoe/data/preprocess.py for the layout.

Example:
    python tools/preprocess_data.py --corpus data/corpus --out data/tok_bpe4k \\
        --tokenizer bpe --vocab-size 4096
    python tools/preprocess_data.py --corpus data/corpus --out data/tok_gpt2 --tokenizer gpt2
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus", required=True, help="directory from tools/build_corpus.py")
    p.add_argument("--out", required=True, help="output directory for .bin/.idx files")
    p.add_argument("--tokenizer", choices=("bpe", "gpt2"), default="bpe",
                   help="bpe: train a small byte-level BPE here; gpt2: the real GPT-2 BPE")
    p.add_argument("--vocab-size", type=int, default=4096, help="trained BPE vocab size")
    p.add_argument("--bpe-train-mb", type=float, default=4.0,
                   help="train-split MB per domain used to train the BPE")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.time()
    try:
        config = PreprocessConfig(corpus_dir=args.corpus, out_dir=args.out,
                                  tokenizer=args.tokenizer, vocab_size=args.vocab_size,
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
