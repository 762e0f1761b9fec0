"""layers/builders.py reads and rebuilds Megatron 0.19.2's two spec forms (ModuleSpec and
functools.partial builders) the same way, keeping the form and never mutating the input."""

import functools

from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_mvmoe.layers.builders import (as_builder, is_builder, module_of, parts,
                                            rebuilt)


class _Marker:
    def __init__(self, submodules=None, **params):
        self.submodules, self.params = submodules, params


def test_megatron_moe_spec_is_a_builder_and_reads_back():
    spec = get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=False)
    assert is_builder(spec) and module_of(spec) is MoELayer
    assert parts(spec).submodules.experts is not None


def test_rebuilt_keeps_the_form_and_leaves_the_input_alone():
    builder = as_builder(_Marker, submodules="subs", width=3)
    spec = ModuleSpec(module=_Marker, params={"width": 3}, submodules="subs")
    for original in (builder, spec):
        swapped = rebuilt(original, submodules="new", params={"width": 4})
        assert type(swapped) is type(original)
        assert parts(swapped).submodules == "new" and parts(swapped).params == {"width": 4}
        assert parts(original).submodules == "subs" and parts(original).params == {"width": 3}
    built = rebuilt(builder, params={"width": 5})()
    assert built.submodules == "subs" and built.params == {"width": 5}


def test_classmethod_builders_report_their_class():
    assert module_of(functools.partial(MLP.as_mlp_submodule)) is MLP
