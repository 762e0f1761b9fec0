"""The documentation of a config field, read from its attribute docstring (the string
literal right under the field in the dataclass body), so `--help` says what the field's
docstring says and the flag table does not restate it.

Design choices:
- Read with `ast` from the class's source, as the attribute docstrings Sphinx and
  torchtitan's job_config rely on: Python keeps no such docstring at run time.
- A dotted path walks nested configs by their annotations (`model.multi_view.num_routers`
  -> MultiViewConfig.num_routers). A field without a docstring, or a path into `extra`
  (Megatron TransformerConfig fields we pass through), has no doc here: its flag keeps a
  help text of its own.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from functools import lru_cache
from typing import Dict, Optional


@lru_cache(maxsize=None)
def field_docs(cls: type) -> Dict[str, str]:
    """{field name: its docstring, whitespace folded} of one dataclass (own body only;
    bases are read too, the subclass's docstring wins)."""
    docs: Dict[str, str] = {}
    for base in reversed(cls.__mro__[:-1]):
        if dataclasses.is_dataclass(base):
            docs.update(_own_docs(base))
    return docs


def _own_docs(cls: type) -> Dict[str, str]:
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # no source (e.g. built in a REPL): no docs, not an error
        return {}
    tree = ast.parse(textwrap.dedent(source))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def doc_of(root: type, path: str) -> Optional[str]:
    """The docstring of the field at dotted `path` under dataclass `root`, or None."""
    cls, *parents = root, *path.split(".")[:-1]
    for part in parents:
        if not dataclasses.is_dataclass(cls):
            return None
        hint = typing.get_type_hints(cls).get(part)
        if hint is None or not dataclasses.is_dataclass(hint):
            return None
        cls = hint
    return field_docs(cls).get(path.rsplit(".", 1)[-1]) if dataclasses.is_dataclass(
        cls) else None
