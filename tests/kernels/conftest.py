"""Kernel tests: make `mvmoe_kernels` importable even where the editable install does not map
the repository's kernels/ directory to that name yet (setup.py's find_packages only sees the
directory name `kernels`); then load it from the path under its package name."""
import importlib.util
import pathlib
import sys

KERNELS_DIR = pathlib.Path(__file__).resolve().parents[2] / "kernels"


def _ensure_mvmoe_kernels() -> None:
    if "mvmoe_kernels" in sys.modules or importlib.util.find_spec("mvmoe_kernels") is not None:
        return
    spec = importlib.util.spec_from_file_location(
        "mvmoe_kernels", KERNELS_DIR / "__init__.py",
        submodule_search_locations=[str(KERNELS_DIR)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["mvmoe_kernels"] = module
    spec.loader.exec_module(module)


_ensure_mvmoe_kernels()
