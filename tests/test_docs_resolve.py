"""Docs that cannot drift: every `megatron_mvmoe/...` and `tests/...py` path and every dotted
module name (`megatron_mvmoe.analysis.stats`, or `analysis.routing.interventions` written from
inside the package) in docs/*.md, README.md, the sources of megatron_mvmoe/, mvmoe_kernels/
and tools/ (docstrings and comments) and the rendered `--help` of the trainer and every tool
names a file, package or module-level name that exists. A module that moves leaves its old
name behind in prose (`analysis.a2a_counter`, `analysis.interventions`, `analysis.wire` did):
this test names the file and the stale name.

Relative dotted names are checked for the subpackages whose name is not also a run-config
section or a common variable (`training.seed`, `data.path`, `config.hidden_size` are fields).
"""

import argparse
import ast
import contextlib
import functools
import importlib
import io
import pathlib
import re
import sys
import tokenize
from typing import Iterator, List, Optional, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_mvmoe"
AMBIGUOUS = {"config", "data", "training"}
"""Subpackage names that are also run-config sections or variable names in prose."""
SUFFIXES = {"py", "md", "json", "yaml", "yml", "txt", "sh", "jsonl", "bin", "idx", "pt"}
PATH_RE = re.compile(r"megatron_mvmoe/[\w./-]*\w|(?<![\w/.-])tests/[\w./-]*\.py\b")
"""Package paths, and test file paths (what a test move breaks)."""
SUBPACKAGES = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
DOTTED_RE = re.compile(r"(?<![\w./-])((?:megatron_mvmoe|" + "|".join(SUBPACKAGES)
                       + r")(?:\.\w+)+)")


def doc_texts() -> Iterator[Tuple[str, str]]:
    """(where, text) of every doc page and every source file the rule covers."""
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield str(path.relative_to(ROOT)), path.read_text()
    for folder in ("megatron_mvmoe", "mvmoe_kernels", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield str(path.relative_to(ROOT)), prose_of(path.read_text())


def prose_of(source: str) -> str:
    """A source file's docstrings (every bare string statement: module, class, function and
    attribute docstrings) and comments; code and data strings (format tags such as
    "megatron_mvmoe.corpus/1") are not prose. Help strings are read rendered, below."""
    strings = [node.value.value for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
               and isinstance(node.value.value, str)]
    comments = [token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
                if token.type == tokenize.COMMENT]
    return "\n".join(strings + comments)


@functools.lru_cache(maxsize=None)
def defined_names(module_file: pathlib.Path) -> frozenset:
    """Names a module defines or imports at its top level (what `module.name` can mean)."""
    names = set()
    for node in ast.parse(module_file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return frozenset(names)


def _module_file(parts: List[str]) -> Optional[pathlib.Path]:
    path = ROOT.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def dotted_resolves(name: str) -> bool:
    """`a.b.c`: the longest module prefix exists, and the next part (if any) is a name it
    defines; deeper parts are attributes this test does not follow."""
    parts = name.split(".")
    if parts[0] != "megatron_mvmoe":
        parts = ["megatron_mvmoe", *parts]
    for end in range(len(parts), 1, -1):
        module_file = _module_file(parts[:end])
        if module_file is not None:
            return end == len(parts) or parts[end] in defined_names(module_file)
    return False


def stale_names(text: str) -> List[str]:
    """The paths and dotted names in `text` that name nothing."""
    stale = [path for path in PATH_RE.findall(text)
             if "*" not in path and not (ROOT / path.rstrip(".")).exists()]
    for name in DOTTED_RE.findall(text):
        parts = name.split(".")
        if parts[-1] in SUFFIXES:  # a file name written as prose (`routing.py`)
            continue
        if parts[0] in AMBIGUOUS:
            continue
        if not dotted_resolves(name):
            stale.append(name)
    return stale


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__()
        self.parser = parser


def tool_parser(name: str) -> Optional[argparse.ArgumentParser]:
    """A tool's parser, taken from its own main() at parse time (nothing else runs); None
    for a tool that reads its few arguments by hand (no argparse help to check)."""
    tool = importlib.import_module(name)

    def capture(parser, *args, **kwargs):
        raise _Captured(parser)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", capture)
        patch.setattr(argparse.ArgumentParser, "parse_known_args", capture)
        patch.setattr(sys, "argv", [f"{name}.py", "--help"])
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                _call_main(tool.main)
        except _Captured as captured:
            return captured.parser
    return None


def _call_main(main) -> None:
    try:
        main(["--help"])
    except TypeError as err:
        if "positional argument" not in str(err):
            raise
        main()


def help_texts() -> Iterator[Tuple[str, str]]:
    from megatron_mvmoe.config.flags import build_parser

    yield "pretrain --help", build_parser().format_help()
    sys.path.insert(0, str(ROOT / "tools"))
    for path in sorted((ROOT / "tools").glob("*.py")):
        source = path.read_text()
        if "def main(" not in source:
            continue
        parser = tool_parser(path.stem)
        assert parser is not None or "argparse" not in source, (
            f"tools/{path.name}: main() returned without parsing its arguments")
        if parser is not None:
            yield f"tools/{path.name} --help", parser.format_help()


def test_every_path_and_module_name_in_docs_and_sources_resolves():
    stale = {where: names for where, text in doc_texts() if (names := stale_names(text))}
    assert not stale, f"names that point nowhere (fix the text to the module's new home): {stale}"


def test_every_path_and_module_name_in_help_resolves():
    stale = {where: names for where, text in help_texts() if (names := stale_names(text))}
    assert not stale, f"--help texts naming what does not exist: {stale}"


def test_a_stale_name_is_caught():
    assert stale_names("see analysis.a2a_counter and megatron_mvmoe/analysis/wire.py") == [
        "megatron_mvmoe/analysis/wire.py", "analysis.a2a_counter"]
    assert stale_names("tests/training/test_config.py (now tests/config/test_config.py)") == [
        "tests/training/test_config.py"]
    assert stale_names("megatron_mvmoe.analysis.routing.interventions, "
                       "megatron_mvmoe/config/flags.py, training.seed, routing.py, "
                       "megatron_mvmoe.errors.require") == []
    assert stale_names("megatron_mvmoe.errors.no_such_function") == [
        "megatron_mvmoe.errors.no_such_function"]
