"""The one reader of the project's imports, shared by the rule tests (test_dependency_rules.py and
test_import_graph.py): every module a file imports, at any
depth (function-level imports included), each import form resolved to the module it loads:

- `import a.b.c`                          -> a.b.c
- `from a.b import c` (c a module of ours) -> a.b.c   (else, c a name defined in a.b: a.b)
- `from . import c`, `from .. import c`   -> the package, then as above
- `from ..x import y`                     -> <package>.x, then as above

Why the module and not the package: `from megatron_mvmoe import training` recorded as
`megatron_mvmoe` would pass every rule that bans `megatron_mvmoe.training`.
"""

import ast
import pathlib
from typing import Dict, Iterator, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("megatron_mvmoe", "mvmoe_kernels")


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_our_module(name: str, root: pathlib.Path = ROOT) -> bool:
    """`name` is a module or package file under `root` (external packages never are)."""
    path = root.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _package_of(path: pathlib.Path, root: pathlib.Path) -> str:
    """The package a relative import in `path` starts from."""
    name = module_name(path, root)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _absolute_base(node: ast.ImportFrom, package: str) -> str:
    """`from <base> import ...` with the dots of a relative import resolved."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    anchor = parts[: len(parts) - node.level + 1]
    return ".".join(anchor + ([node.module] if node.module else []))


def import_statements(path: pathlib.Path,
                      root: pathlib.Path = ROOT) -> Iterator[Tuple[str, str]]:
    """(module imported, the base it was imported from) for every import in the file.
    For `import x` both are x; for `from b import n` the module is b.n when that is one of
    ours, else b."""
    package = _package_of(path, root)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _absolute_base(node, package)
            for alias in node.names:
                candidate = f"{base}.{alias.name}" if base else alias.name
                yield (candidate if is_our_module(candidate, root) else base), base


def imports_of(path: pathlib.Path, root: pathlib.Path = ROOT) -> Set[str]:
    """Every module a file imports, at any depth, each resolved to the module it loads."""
    return {module for module, _ in import_statements(path, root)}


def graph(root: pathlib.Path = ROOT) -> Dict[str, Set[str]]:
    """module -> what it imports, for every module of PACKAGES under `root`."""
    return {module_name(p, root): imports_of(p, root) for pkg in PACKAGES
            for p in sorted((root / pkg).rglob("*.py"))}
