"""The site GPU image plus the offline wheelhouse cover the package (issue 37): every
third-party package that megatron_mvmoe/ and mvmoe_kernels/ import is on the image
(tools/gpu_image.py IMAGE), in the wheelhouse (WHEELHOUSE, what scripts/wheelhouse.sh
downloads) or a declared optional extra the GPU check never needs; the manifest names each
wheel's sha256 and refuses a wheelhouse over 48 MiB. The rehearsal
(scripts/rehearse_gpu_image.sh) proves the same by importing every module on the image's
versions; this test keeps the declared lists honest in the normal suite, in milliseconds."""
import ast
import hashlib
import pathlib
import sys

import pytest

import gpu_image

ROOT = pathlib.Path(__file__).resolve().parents[2]


def third_party_imports(package_dir: pathlib.Path) -> dict:
    """{top-level import name: first file importing it} over a package's modules, wherever
    the import statement is (module level or inside a function)."""
    found = {}
    for path in sorted(package_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in gpu_image.FIRST_PARTY:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_on_the_image_or_in_the_wheelhouse():
    imports = {}
    for package in gpu_image.FIRST_PARTY:
        imports.update(third_party_imports(ROOT / package))
    allowed = gpu_image.covered_imports() | set(gpu_image.OPTIONAL)
    missing = {name: path for name, path in imports.items() if name not in allowed}
    assert not missing, ("imported, but neither on the site image nor in the wheelhouse "
                         f"(tools/gpu_image.py): {missing}")
    # the wheelhouse carries nothing the package does not import
    wheel_imports = {n for _, names in gpu_image.WHEELHOUSE.values() for n in names}
    assert wheel_imports <= set(imports), wheel_imports - set(imports)


def test_the_wheelhouse_pins_megatron_core_as_setup_py_does():
    setup = (ROOT / "setup.py").read_text()
    for dist, (version, _) in gpu_image.WHEELHOUSE.items():
        assert f'"{dist}=={version}"' in setup, (dist, version)
    assert gpu_image.requirement_lines(gpu_image.IMAGE)[:3] == [
        "torch==2.11.0", "triton==3.6.0", "transformers==5.17.0"]


def test_manifest_names_each_wheel_and_refuses_over_48_mib(tmp_path, capsys):
    small = tmp_path / "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl"
    small.write_bytes(b"wheel")
    assert gpu_image.main(["manifest", str(tmp_path)]) == 0
    rows = (tmp_path / "MANIFEST.tsv").read_text().splitlines()
    assert rows[1] == f"megatron_core\t0.19.2\t{hashlib.sha256(b'wheel').hexdigest()}\t5"
    assert rows[-1] == "total\t\t\t5"
    with open(tmp_path / "big-1.0-py3-none-any.whl", "wb") as fh:
        fh.truncate(48 * 2 ** 20)  # sparse: costs no disk
    capsys.readouterr()
    assert gpu_image.main(["manifest", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "48.0 MiB, over the 48 MiB" in err and "Fix:" in err and err.count("\n") == 1


def test_manifest_of_an_empty_folder_says_how_to_fill_it(tmp_path, capsys):
    assert gpu_image.main(["manifest", str(tmp_path)]) == 1
    assert "scripts/wheelhouse.sh" in capsys.readouterr().err
