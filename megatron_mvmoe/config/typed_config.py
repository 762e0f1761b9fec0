"""Nested dicts (YAML, JSON, flags) -> typed config dataclasses, with errors that name the
field and the fix.

Design choices:
- One loader for every config dataclass of the package (the run config's sections and the
  model configs nested in them): unknown keys are refused by name, every value is checked
  against the field's annotation, and a field whose type is itself a dataclass is loaded
  recursively from a mapping, so `model.multi_view.num_routers` is as typed as
  `training.train_iters`.
- Values are never coerced: YAML gives strings for quoted booleans ("false") and numbers
  ("10"), and a string "false" would otherwise read as true. Ints widen to floats.
- An enum-like field is annotated `Literal[...]` (e.g. `precision: Literal["auto", "bf16",
  "fp32"]`): the annotation is the one list of allowed values, the loader refuses any
  other naming the field and the values, and `check_literals` re-checks a loaded config
  whose fields were set in code. A field whose values are a registry's keys is annotated
  `Annotated[str, OneOf(registry)]`: checked the same way against the keys the registry has
  when it is read (a model variant registered at run time is accepted).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, Mapping



@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: typing hashes hints
class OneOf:
    """`Annotated[str, OneOf(registry)]`: the value is one of `registry`'s keys now."""

    registry: Mapping[str, Any]


def _allowed_values(hint: Any):
    """The values an enum-like hint allows (a tuple), or None for any other hint."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    one_of = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, OneOf)]
    return tuple(one_of[0].registry) if one_of else None


_TYPE_NAMES = {bool: "true/false", int: "an integer", float: "a number", str: "a string"}


def _unwrap_optional(where: str, value: Any, hint: Any):
    """(hint without Optional, whether the value is a legal None)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        if value is None:
            return hint, True
        if value == "" and str in args:
            raise ValueError(f"{where}: empty string. Fix: omit the field or write null to "
                             "leave it unset")
        return next(a for a in args if a is not type(None)), False
    return hint, False


def checked_value(where: str, value: Any, hint: Any) -> Any:
    """`value` if it has the field's declared type, else ValueError naming `where`."""
    hint, is_none = _unwrap_optional(where, value, hint)
    if is_none:
        return None
    allowed = _allowed_values(hint)
    if allowed is not None:
        return _checked_literal(where, value, allowed)
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        return dataclass_from_dict(hint, value, where)
    origin = typing.get_origin(hint) or hint
    if origin in (dict, list):
        if not isinstance(value, origin):
            raise ValueError(f"{where}: expected a {'mapping' if origin is dict else 'list'}, "
                             f"got {value!r}. Fix: write it as YAML {origin.__name__}")
        return value
    if hint is Any:
        return value
    ok = (isinstance(value, bool) if hint is bool else
          isinstance(value, int) and not isinstance(value, bool) if hint is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if hint is float else
          isinstance(value, hint))
    if not ok:
        unquote = " (without quotes)" if isinstance(value, str) else ""
        raise ValueError(f"{where}: expected {_TYPE_NAMES.get(hint, hint)}, got "
                         f"{value!r}. Fix: write {_TYPE_NAMES.get(hint, hint)}{unquote}")
    return float(value) if hint is float else value


def _checked_literal(where: str, value: Any, allowed: tuple) -> Any:
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
        raise ValueError(f"{where}: unknown {value!r}. Fix: use one of "
                         f"{', '.join(str(a) for a in allowed)}")
    return value


def check_literals(config: Any, where: str) -> None:
    """Every `Literal[...]` field of a config dataclass (nested ones included) holds one of
    its values; for configs changed in code after loading (ValueError naming the field)."""
    hints = typing.get_type_hints(type(config), include_extras=True)
    for f in dataclasses.fields(config):
        value, hint = getattr(config, f.name), hints[f.name]
        if dataclasses.is_dataclass(value):
            check_literals(value, f"{where}.{f.name}")
            continue
        hint, is_none = _unwrap_optional(f"{where}.{f.name}", value, hint)
        allowed = None if is_none else _allowed_values(hint)
        if allowed is not None:
            _checked_literal(f"{where}.{f.name}", value, allowed)


def dataclass_from_dict(cls, values: Mapping[str, Any], where: str):
    """`cls(**values)` after refusing unknown keys and checking every value's type."""
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}: expected a mapping of fields, got {values!r}. Fix: write "
                         f"'{where.rsplit('.', 1)[-1]}:' followed by indented 'field: value' "
                         "lines")
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}. Fix: use one of {sorted(known)}")
    hints = typing.get_type_hints(cls, include_extras=True)
    return cls(**{name: checked_value(f"{where}.{name}", value, hints[name])
                  for name, value in values.items()})


def deep_merge(base: Mapping[str, Any], top: Mapping[str, Any]) -> Dict[str, Any]:
    """`base` with `top`'s values on it; mappings merge key by key, None in `top` keeps
    `base`'s value (an unset field)."""
    merged: Dict[str, Any] = dict(base)
    for key, value in top.items():
        if value is None:
            merged.setdefault(key, None)
        elif isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged
