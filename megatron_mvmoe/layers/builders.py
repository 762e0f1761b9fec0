"""Megatron-Core 0.19.2's two ways of describing a module, read and rebuilt in one place.

Layer and block slots are still `ModuleSpec`s, but MLP/MoE/experts/shared-expert slots are
"builders": `functools.partial(Class, submodules=..., **params)` (`moe_module_specs.py:87`,
`backends.py:133`) that their parent calls directly, e.g. TransformerLayer calls
`mlp(config=, pg_collection=, is_mtp_layer=, name=)`. Code that swaps a class or its
submodules (our decoder-block specs, BitNet, MH-MoE) goes through these helpers instead of
`isinstance(partial)` checks scattered over the package.

Design choices:
- `parts(spec)` gives the (module, params, submodules) triple of either form; `rebuilt`
  returns the SAME form with some parts replaced, so a Megatron builder stays a builder.
  Nothing is mutated: specs are module-level state shared by every layer in Megatron.
- `build(spec, *args, **kwargs)` instantiates any form (class, ModuleSpec, builder).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional

from megatron.core.transformer.spec_utils import ModuleSpec, build_module

_UNSET = object()


@dataclass(frozen=True)
class SpecParts:
    """What a ModuleSpec or a builder partial describes."""

    module: Any
    """The class (or function) that builds the module."""
    params: Dict[str, Any] = field(default_factory=dict)
    """Constructor keywords other than `submodules`."""
    submodules: Any = None


def is_builder(spec: Any) -> bool:
    """True for Megatron 0.19.2's `functools.partial` builders."""
    return isinstance(spec, functools.partial)


def parts(spec: Any) -> SpecParts:
    """The (module, params, submodules) of a class, ModuleSpec or builder."""
    if isinstance(spec, ModuleSpec):
        return SpecParts(spec.module, dict(spec.params), spec.submodules)
    if is_builder(spec):
        assert not spec.args, f"builders take keywords only, got positional {spec.args}"
        params = dict(spec.keywords)
        submodules = params.pop("submodules", None)
        return SpecParts(spec.func, params, submodules)
    return SpecParts(spec)


def module_of(spec: Any) -> Any:
    """The class a class, ModuleSpec or builder builds (a builder may wrap a classmethod
    constructor, e.g. dense slots are `partial(MLP.as_mlp_submodule, ...)`)."""
    module = parts(spec).module
    owner = getattr(module, "__self__", None)
    return owner if isinstance(owner, type) else module


def rebuilt(spec: Any, module: Any = _UNSET, params: Optional[Dict[str, Any]] = None,
            submodules: Any = _UNSET) -> Any:
    """A new spec of the same form as `spec` with the given parts replaced."""
    old = parts(spec)
    module = old.module if module is _UNSET else module
    params = old.params if params is None else dict(params)
    submodules = old.submodules if submodules is _UNSET else submodules
    if isinstance(spec, ModuleSpec):
        return replace(spec, module=module, params=params, submodules=submodules)
    if is_builder(spec):
        if submodules is not None:
            params = dict(params, submodules=submodules)
        return functools.partial(module, **params)
    assert submodules is None and not params, "a bare class has no params or submodules"
    return module


def as_builder(module: Any, submodules: Any = None, **params: Any) -> functools.partial:
    """A builder (Megatron 0.19.2's form for MLP/MoE slots) for `module`."""
    if submodules is not None:
        params["submodules"] = submodules
    return functools.partial(module, **params)


def build(spec: Any, *args: Any, **kwargs: Any) -> Any:
    """Instantiate a class, ModuleSpec or builder with the given arguments."""
    if is_builder(spec):
        return spec(*args, **kwargs)
    return build_module(spec, *args, **kwargs)
