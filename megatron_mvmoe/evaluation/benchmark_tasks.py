"""lm-eval 0.4.13's own task definitions pointed at the local benchmark files.

Design choices:
- For each task, one YAML in a task directory that `include`s lm-eval's own YAML (so its
  prompt, choices, target, metrics, normalisation and few-shot settings are kept) and
  changes only the data source: the `json` builder on our JSONL files, and the split names
  those files provide (no train split, so lm-eval draws few-shot examples from validation).
  The override keeps the task's name, so lm-eval's groups (`mmlu` and its four categories)
  pick it up; TaskManager ranks include_path after its defaults, so ours win.
- A task asked for whose local file is absent is refused before any model is loaded, in one
  line naming the task, the file and the fix (benchmark_data.FIX).
- Chance levels come from the data (mean of 1 / number of options), LAMBADA has none.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional, Sequence

from megatron_mvmoe.evaluation import benchmark_data as data

STANDARD = ["arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "boolq",
            "openbookqa", "social_iqa", "lambada_openai", "mmlu"]
# the metric each task's score is, for tables and the macro mean: length-normalised accuracy
# where lm-eval reports it (options of different lengths), plain accuracy elsewhere
PRIMARY = {"arc_easy": "acc_norm", "arc_challenge": "acc_norm", "hellaswag": "acc_norm",
           "piqa": "acc_norm", "openbookqa": "acc_norm"}
# lm-eval's YAML of each local task, relative to lm_eval/tasks
LM_EVAL_YAML = {"arc_easy": "arc/arc_easy.yaml", "arc_challenge": "arc/arc_challenge.yaml",
                "hellaswag": "hellaswag/hellaswag.yaml", "piqa": "piqa/piqa.yaml",
                "winogrande": "winogrande/default.yaml", "boolq": "super_glue/boolq/default.yaml",
                "openbookqa": "openbookqa/openbookqa.yaml", "social_iqa": "siqa/siqa.yaml",
                "lambada_openai": "lambada/lambada_openai.yaml"}
LM_EVAL_YAML.update({f"mmlu_{s}": f"mmlu/default/mmlu_{s}.yaml" for s in data.MMLU_SUBJECTS})
SPLIT_KEYS = {"test": "test_split", "validation": "validation_split"}
HOOK = "mvmoe_local_data"  # the module lm-eval's `!function` loads from the task directory


class MissingBenchmarkData(ValueError):
    """A requested task has no local data file."""


def expand(names: Sequence[str]) -> List[str]:
    """`standard` stands for STANDARD; other names are kept, in order, without repeats."""
    out: List[str] = []
    for name in names:
        for task in (STANDARD if name == "standard" else [name]):
            if task not in out:
                out.append(task)
    return out


def leaves(task: str) -> List[str]:
    """The local tasks `task` evaluates (mmlu: its 57 subjects); [] for a non-local task."""
    if task == "mmlu":
        return [f"mmlu_{s}" for s in data.MMLU_SUBJECTS]
    return [task] if task in data.SPLITS else []


def is_local(task: str) -> bool:
    return bool(leaves(task))


def check_local(tasks: Sequence[str], root: str) -> None:
    """Raise MissingBenchmarkData for the first local task whose files are not on disk."""
    for task in tasks:
        for leaf in leaves(task):
            for split in data.SPLITS[leaf]:
                path = data.split_file(root, leaf, split.name)
                if not os.path.exists(path):
                    raise MissingBenchmarkData(
                        f"task {task}: no local data ({path} is missing). Fix: {data.FIX}")


def load_local(data_files: Dict[str, str], **_metadata):
    """lm-eval's custom_dataset hook: the JSONL splits read by pyarrow straight into
    datasets' in-memory tables (the `json` builder would first write every split into the
    datasets cache: about a minute for the 183 files, on every new cache)."""
    import datasets
    from pyarrow import json as pa_json

    return datasets.DatasetDict({split: datasets.Dataset(pa_json.read_json(path))
                                 for split, path in data_files.items()})


def _yaml(leaf: str, root: str) -> str:
    import lm_eval.tasks

    include = os.path.join(os.path.dirname(lm_eval.tasks.__file__), LM_EVAL_YAML[leaf])
    splits = [s.name for s in data.SPLITS[leaf]]
    lines = [f"include: {include}", f"task: {leaf}", "dataset_path: json",
             "dataset_name: null", f"custom_dataset: !function {HOOK}.load",
             "dataset_kwargs:", "  data_files:"]
    lines += [f"    {s}: {data.split_file(root, leaf, s)}" for s in splits]
    lines.append("training_split: null")
    lines += [f"{key}: {s if s in splits else 'null'}" for s, key in SPLIT_KEYS.items()]
    if leaf.startswith("mmlu_"):
        lines.append("fewshot_split: dev")  # lm-eval's own MMLU few-shot source
    return "\n".join(lines) + "\n"


def task_manager(task_dir: str, tasks: Sequence[str], root: Optional[str] = None):
    """An lm-eval TaskManager for `tasks` with the local ones pointed at the local files.
    When every task is local, only the directories it needs are indexed (lm-eval's groups
    for mmlu, and the overrides), not lm-eval's thousands of task files: that index costs
    a minute on a loaded 2-core machine."""
    import lm_eval.tasks
    from lm_eval.tasks import TaskManager

    write_overrides(task_dir, tasks, root)
    if not all(is_local(t) for t in tasks):
        return TaskManager(include_path=task_dir)
    groups = [os.path.join(os.path.dirname(lm_eval.tasks.__file__), "mmlu", "default")]
    return TaskManager(include_path=groups * any(t.startswith("mmlu") for t in tasks) +
                       [task_dir], include_defaults=False)


def write_overrides(task_dir: str, tasks: Sequence[str], root: Optional[str] = None) -> None:
    """One override YAML per local leaf task of `tasks` in `task_dir` (TaskManager's
    include_path)."""
    root = os.path.abspath(root or data.default_root())
    os.makedirs(task_dir, exist_ok=True)
    with open(os.path.join(task_dir, f"{HOOK}.py"), "w") as fh:  # what !function imports
        fh.write("from megatron_mvmoe.evaluation.benchmark_tasks import load_local as load\n")
    for task in tasks:
        for leaf in leaves(task):
            with open(os.path.join(task_dir, f"{leaf}.yaml"), "w") as fh:
                fh.write(_yaml(leaf, root))
    # one warning per overridden task ("overrides existing task") is the design, not news
    logging.getLogger("lm_eval.tasks._index").setLevel(logging.ERROR)


def chance(task: str, root: Optional[str] = None) -> Optional[float]:
    """The evaluated split's chance accuracy (mmlu: item-weighted over its subjects)."""
    manifest = data.read_manifest(root or data.default_root()) or {"tasks": {}}
    splits = [manifest["tasks"].get(leaf, {}).get(data.SPLITS[leaf][0].name)
              for leaf in leaves(task)]
    if not splits or None in splits or any(s["chance"] is None for s in splits):
        return None
    items = sum(s["items"] for s in splits)
    return sum(s["chance"] * s["items"] for s in splits) / items


def eval_split(task: str) -> Optional[str]:
    return data.SPLITS[leaves(task)[0]][0].name if is_local(task) else None


def primary_metric(task: str, metrics: Dict[str, float]) -> Optional[str]:
    for name in (PRIMARY.get(task), "acc", "acc_norm"):
        if name and name in metrics:
            return name
    return None


def score_table(out: Dict) -> str:
    """Markdown: one row per task of out["tasks"] (split, items, metric, score, stderr,
    chance), then the macro mean out["mean"] (tools/lm_eval_run.py's summary)."""
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    lines = ["| task | split | items | metric | score | stderr | chance |",
             "|---|---|---|---|---|---|---|"]
    for task, r in out["tasks"].items():
        lines.append(f"| {task} | {r['split'] or '-'} | {r['items']} | {r['metric']} | "
                     f"{fmt(r['score'])} | {fmt(r['stderr'])} | {fmt(r['chance'])} |")
    lines.append(f"| macro mean | | | | {fmt(out['mean'])} | | |")
    return "\n".join(lines)
