"""The package's dependency rules, read from every module's imports (function-level imports
included), so the layering cannot erode silently:

- functional (the papers' math), config.variants and errors import neither Megatron nor any
  other part of megatron_mvmoe: they are pure and testable without the engine;
- config (run config, model section, presets, variants, flag tables) sits at the bottom:
  from megatron_mvmoe it imports only errors, functional, parallel and platform, never
  models, training, analysis or data (so nothing it needs can import it back);
- platform imports no other part of megatron_mvmoe (everything else builds on it);
- mvmoe_kernels uses only functional from megatron_mvmoe (its references ARE the math);
- training never imports analysis (what the trainer needs, e.g. the router-diversity math,
  lives below it) nor toolkit; analysis never imports training;
- toolkit (the tools' one front door: open a run or checkpoint, tool flags, generation)
  imports neither training nor analysis (analysis and the tools build on it);
- models, layers, checkpointing (reading a checkpoint without a trainer), data, planning
  (the planner: training's start-up fit check and tools/plan.py both use it) and a2a_model
  (the all-to-all byte model: the trainer's live metrics and the analysis tools use it) never
  import analysis, toolkit or training;
- only tests (and testing itself) import megatron_mvmoe.testing (tools launch local ranks
  through megatron_mvmoe.launch.local_ranks);
- dev_cluster (the root-only Slurm test cluster) imports no other part of megatron_mvmoe,
  and no part of the package imports it (tools and tests do);
- tools/ are leaves: no tool imports another tool, and only tools/megatron_moe_tests.py (it
  runs Megatron's own tests) imports megatron_mvmoe.testing.

Imports are read by tests/import_walker.py, every form (`from megatron_mvmoe import training`,
`from .. import training`) resolved to the module it loads.

KNOWN_VIOLATIONS lists the edges that still break a rule, as debt: a new one fails the test,
and removing one (the fix) fails it too until the list is shortened.
"""

import pathlib
from typing import Dict, Set, Tuple

import pytest

from import_walker import ROOT, graph, imports_of

KNOWN_VIOLATIONS: Set[Tuple[str, str]] = set()
# Empty: the last edge (training's start-up fit check asking the memory planner) went when
# the planner moved out of analysis/ into planning/, below training.


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


PURE = ("megatron_mvmoe.functional", "megatron_mvmoe.config.variants", "megatron_mvmoe.errors")
CONFIG_MAY_IMPORT = ("megatron_mvmoe.config", "megatron_mvmoe.errors",
                     "megatron_mvmoe.functional", "megatron_mvmoe.parallel",
                     "megatron_mvmoe.platform")
# (modules the rule applies to, forbidden import prefix, prefixes still allowed under it)
RULES = [
    *[(pure, "megatron", ()) for pure in PURE],
    *[(pure, "megatron_mvmoe", PURE) for pure in PURE],
    ("megatron_mvmoe.platform", "megatron_mvmoe", ("megatron_mvmoe.platform",)),
    ("megatron_mvmoe.config", "megatron_mvmoe", CONFIG_MAY_IMPORT),
    ("mvmoe_kernels", "megatron_mvmoe", ("megatron_mvmoe.functional",)),
    ("megatron_mvmoe.analysis", "megatron_mvmoe.training", ()),
    ("megatron_mvmoe.training", "megatron_mvmoe.analysis", ()),
    ("megatron_mvmoe.training", "megatron_mvmoe.toolkit", ()),
    ("megatron_mvmoe.toolkit", "megatron_mvmoe.training", ()),
    ("megatron_mvmoe.toolkit", "megatron_mvmoe.analysis", ()),
    *[(below, above, ()) for below in ("megatron_mvmoe.models", "megatron_mvmoe.layers",
                                       "megatron_mvmoe.checkpointing", "megatron_mvmoe.data",
                                       "megatron_mvmoe.planning", "megatron_mvmoe.a2a_model")
      for above in ("megatron_mvmoe.analysis", "megatron_mvmoe.toolkit",
                    "megatron_mvmoe.training")],
    ("", "megatron_mvmoe.testing", ()),  # testing itself is exempt (see violations)
    ("megatron_mvmoe.dev_cluster", "megatron_mvmoe", ("megatron_mvmoe.dev_cluster",)),
    ("", "megatron_mvmoe.dev_cluster", ()),  # dev_cluster itself is exempt
]


def violations(edges: Dict[str, Set[str]]) -> Set[Tuple[str, str]]:
    """(importer, forbidden prefix) for every import that breaks a rule."""
    out = set()
    for module, targets in edges.items():
        for applies_to, forbidden, allowed in RULES:
            if applies_to and not _within(module, applies_to):
                continue
            if not applies_to and _within(module, forbidden):
                continue  # a package-wide ban on X does not stop X importing itself
            for target in targets:
                if _within(target, forbidden) and not any(_within(target, a) for a in allowed):
                    out.add((module, forbidden))
    return out


def test_dependency_rules_hold_except_the_known_debt():
    found = violations(graph())
    assert found - KNOWN_VIOLATIONS == set(), f"new rule violations: {found - KNOWN_VIOLATIONS}"
    assert KNOWN_VIOLATIONS - found == set(), (
        f"fixed, remove from KNOWN_VIOLATIONS: {KNOWN_VIOLATIONS - found}")


def test_a_forbidden_import_is_caught():
    edges = graph()
    edges["megatron_mvmoe.functional.routing"] = edges["megatron_mvmoe.functional.routing"] | {
        "megatron.core.transformer.moe.moe_utils"}
    edges["megatron_mvmoe.analysis.stats"] = edges["megatron_mvmoe.analysis.stats"] | {
        "megatron_mvmoe.training.pretrain"}
    edges["megatron_mvmoe.layers.latent_moe"] = edges["megatron_mvmoe.layers.latent_moe"] | {
        "megatron_mvmoe.testing.spawn"}
    edges["megatron_mvmoe.launch.mpi"] = edges["megatron_mvmoe.launch.mpi"] | {
        "megatron_mvmoe.dev_cluster.netns"}
    edges["megatron_mvmoe.dev_cluster.cli"] = edges["megatron_mvmoe.dev_cluster.cli"] | {
        "megatron_mvmoe.launch.hostlist"}
    edges["megatron_mvmoe.config.run_config"] = edges["megatron_mvmoe.config.run_config"] | {
        "megatron_mvmoe.models.build"}
    found = violations(edges)
    assert ("megatron_mvmoe.launch.mpi", "megatron_mvmoe.dev_cluster") in found
    assert ("megatron_mvmoe.dev_cluster.cli", "megatron_mvmoe") in found
    assert ("megatron_mvmoe.config.run_config", "megatron_mvmoe") in found
    assert ("megatron_mvmoe.functional.routing", "megatron") in found
    assert ("megatron_mvmoe.analysis.stats", "megatron_mvmoe.training") in found
    assert ("megatron_mvmoe.layers.latent_moe", "megatron_mvmoe.testing") in found


# ------------------------------------------------------------------------- tools/
def tool_names(root: pathlib.Path = ROOT) -> frozenset:
    return frozenset(p.stem for p in (root / "tools").glob("*.py"))
TOOLS_ALLOWED_TESTING = {
    "tools.megatron_moe_tests": "runs Megatron-Core's own MoE tests through the test adapter",
}


def tool_graph(root: pathlib.Path = ROOT) -> Dict[str, Set[str]]:
    return {f"tools.{p.stem}": imports_of(p, root) for p in sorted((root / "tools").glob("*.py"))}


def tool_violations(edges: Dict[str, Set[str]],
                    names: frozenset = frozenset()) -> Set[Tuple[str, str]]:
    """Tools are leaves: none imports another tool (shared logic lives in the package), and
    only the listed ones import megatron_mvmoe.testing (tools launch ranks through
    megatron_mvmoe.launch.local_ranks). `names`: the tools' module names (default: ours)."""
    names = names or tool_names()
    out = set()
    for tool, targets in edges.items():
        for target in targets:
            if target.split(".")[0] in names:
                out.add((tool, f"tool {target}"))
            if _within(target, "megatron_mvmoe.testing") and tool not in TOOLS_ALLOWED_TESTING:
                out.add((tool, "megatron_mvmoe.testing"))
    return out


def test_tools_are_leaves():
    assert tool_violations(tool_graph()) == set()


def test_a_tool_importing_a_tool_or_testing_is_caught():
    edges = tool_graph()
    edges["tools.plan"] = edges["tools.plan"] | {"a2a_volume", "megatron_mvmoe.testing.spawn"}
    assert tool_violations(edges) == {("tools.plan", "tool a2a_volume"),
                                      ("tools.plan", "megatron_mvmoe.testing")}


# ------------------------------------------------------------ the checker on files on disk
def _write(root: pathlib.Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_checker_reads_an_upward_import_from_files_on_disk(tmp_path):
    """Must show (issue 24): the rules fail on a deliberate upward import written as source
    files: training/ importing analysis/ (inside a function, as the old diversity metrics
    did), and a tool importing another tool. A clean copy of the same tree passes."""
    _write(tmp_path, "megatron_mvmoe/__init__.py", "")
    _write(tmp_path, "megatron_mvmoe/analysis/__init__.py", "")
    _write(tmp_path, "megatron_mvmoe/analysis/stats.py", "import torch\n")
    _write(tmp_path, "megatron_mvmoe/training/__init__.py", "")
    _write(tmp_path, "megatron_mvmoe/training/metrics.py",
           "def watch():\n    from ..analysis.stats import nanmean\n    return nanmean\n")
    _write(tmp_path, "megatron_mvmoe/toolkit/__init__.py", "")
    _write(tmp_path, "megatron_mvmoe/toolkit/flags.py",
           "from megatron_mvmoe.training import metrics\n")
    _write(tmp_path, "tools/plan.py", "from megatron_mvmoe.toolkit import flags\n")
    _write(tmp_path, "tools/report.py", "def main():\n    import plan\n    return plan\n")
    assert violations(graph(tmp_path)) == {
        ("megatron_mvmoe.training.metrics", "megatron_mvmoe.analysis"),
        ("megatron_mvmoe.toolkit.flags", "megatron_mvmoe.training")}
    assert tool_violations(tool_graph(tmp_path), tool_names(tmp_path)) == {
        ("tools.report", "tool plan")}
    _write(tmp_path, "megatron_mvmoe/training/metrics.py", "import torch\n")
    _write(tmp_path, "megatron_mvmoe/toolkit/flags.py", "import argparse\n")
    _write(tmp_path, "tools/report.py", "from megatron_mvmoe.toolkit import flags\n")
    assert violations(graph(tmp_path)) == set()
    assert tool_violations(tool_graph(tmp_path), tool_names(tmp_path)) == set()



PLANTED_FORMS = {
    "absolute module": "from megatron_mvmoe.analysis.stats import nanmean\n",
    "from-package-import-module": "from megatron_mvmoe import analysis\n",
    "from-package-import-submodule": "from megatron_mvmoe.analysis import stats\n",
    "relative from .. import x": "def watch():\n    from .. import analysis\n",
    "relative from ..x import y": "from ..analysis import stats\n",
}
"""One training -> analysis import per import form, each planted in training/metrics.py."""


@pytest.mark.parametrize("form", sorted(PLANTED_FORMS))
def test_a_planted_violation_is_caught_in_every_import_form(tmp_path, form):
    """Issue 40: `from megatron_mvmoe import analysis` and `from .. import analysis` were read
    as the bare package, so the training -> analysis import they make passed every rule."""
    _write(tmp_path, "megatron_mvmoe/__init__.py", "")
    for package in ("analysis", "training"):
        _write(tmp_path, f"megatron_mvmoe/{package}/__init__.py", "")
    _write(tmp_path, "megatron_mvmoe/analysis/stats.py", "nanmean = None\n")
    _write(tmp_path, "megatron_mvmoe/training/metrics.py", "from . import loop\n")
    _write(tmp_path, "megatron_mvmoe/training/loop.py", "from .metrics import watch\n")
    assert violations(graph(tmp_path)) == set()
    _write(tmp_path, "megatron_mvmoe/training/metrics.py", PLANTED_FORMS[form])
    assert violations(graph(tmp_path)) == {
        ("megatron_mvmoe.training.metrics", "megatron_mvmoe.analysis")}, PLANTED_FORMS[form]
