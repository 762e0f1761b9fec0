"""A tiny local multiple-choice task for lm-eval, made from our own held-out text.

Design choices:
- "Which continuation really follows?": each document is a held-out paragraph cut into a
  context (its first `context_words` words) and its true next `choice_words` words; the
  other choices are the same-length continuations of other paragraphs. Chance is
  1 / num_choices; a model that learned the text's statistics does better.
- Written as lm-eval's own task format: a JSONL of docs plus a task YAML
  (`dataset_path: json`, `output_type: multiple_choice`, metrics acc and acc_norm), loaded
  with `TaskManager(include_path=...)`: nothing is downloaded, so it runs offline.
- Deterministic: the paragraph sample and the choice order come from `seed`.
"""

from __future__ import annotations

import json
import os
import random
from typing import Iterable, List

TASK_NAME = "mvmoe_continuation"


def _paragraphs(texts: Iterable[str], min_words: int) -> List[List[str]]:
    out = []
    for text in texts:
        for paragraph in text.split("\n\n"):
            words = paragraph.split()
            if len(words) >= min_words:
                out.append(words)
    return out


def read_texts(path: str, key: str = "text") -> List[str]:
    """Texts of a JSONL file ({key: ...} per line) or of a plain text file."""
    with open(path, encoding="utf-8", errors="ignore") as fh:
        if path.endswith(".jsonl"):
            return [json.loads(line)[key] for line in fh if line.strip()]
        return [fh.read()]


def make_docs(texts: Iterable[str], num_docs: int = 100, num_choices: int = 4,
              context_words: int = 16, choice_words: int = 6, seed: int = 1234) -> List[dict]:
    paragraphs = _paragraphs(texts, context_words + choice_words)
    if len(paragraphs) < max(num_choices, 2):
        raise ValueError(f"lm-eval task: only {len(paragraphs)} paragraphs of >= "
                         f"{context_words + choice_words} words. Fix: more text, or smaller "
                         "--context-words/--choice-words")
    rng = random.Random(seed)
    picked = rng.sample(range(len(paragraphs)), min(num_docs, len(paragraphs)))
    docs = []
    for index in picked:
        words = paragraphs[index]
        others = rng.sample([i for i in range(len(paragraphs)) if i != index], num_choices - 1)
        true = " ".join(words[context_words:context_words + choice_words])
        wrong = [" ".join(paragraphs[i][context_words:context_words + choice_words])
                 for i in others]
        choices = [true] + wrong
        rng.shuffle(choices)
        docs.append({"context": " ".join(words[:context_words]), "choices": choices,
                     "label": choices.index(true)})
    return docs


def write_task(docs: List[dict], task_dir: str) -> str:
    """The docs JSONL and the task YAML in task_dir; returns task_dir."""
    os.makedirs(task_dir, exist_ok=True)
    data = os.path.abspath(os.path.join(task_dir, f"{TASK_NAME}.jsonl"))
    with open(data, "w") as fh:
        for doc in docs:
            fh.write(json.dumps(doc) + "\n")
    yaml_text = f"""task: {TASK_NAME}
dataset_path: json
dataset_kwargs:
  data_files:
    validation: {data}
output_type: multiple_choice
validation_split: validation
test_split: null
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: label
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
    with open(os.path.join(task_dir, f"{TASK_NAME}.yaml"), "w") as fh:
        fh.write(yaml_text)
    return task_dir
