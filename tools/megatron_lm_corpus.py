"""Megatron-LM's 63 MoE functional-test launch lines as a corpus (issue 36 item 4).

Source: NVIDIA/Megatron-LM core_r0.19.0 (commit f8837c04ef6cbef6cdefb8de001aad63178aebbf),
`tests/functional_tests/test_cases/moe/*/model_config.yaml`, each file's MODEL_ARGS in order
(`key: true` a bare switch, `false` left out, as tools/gen_megatron_lm_parity.py's
line_from_config). `--generate` writes them to tests/assets/megatron_lm_corpus.json with one
change, the size rule SHRINK below (applied to a flag's value wherever the line gives it);
the `${...}` paths become placeholders. A value wrapped in brackets, `"[moe_act]"`, becomes
the words inside, as Megatron-LM's launcher passes it (`launcher_words`). Nothing else of a
line is changed.

At run time (`runnable_line`) the launcher and the paths are replaced: the data and
tokenizer flags (--data-path, --vocab-file, --merge-file, --tokenizer-type,
--tokenizer-model, --data-cache-path, --split) become `--mock-data --tokenizer-type
NullTokenizer --vocab-size 512`, --save and --load one scratch checkpoint directory (a fresh
job) and --tensorboard-dir another.

    python tools/megatron_lm_corpus.py --generate [--mirror DIR] [--check]
    python tools/megatron_lm_corpus.py --resolve [--json]     # every line, no training
    python tools/megatron_lm_corpus.py --train [CASE ...] [--max-ranks 8] [--timeout 900] [--log-dir DIR]

--resolve resolves every line through config_from_args at WORLD_SIZE 8 (the tests' 8 GPUs) and
prints each line's outcome and the refusal reasons counted (tests/training/
test_megatron_lm_corpus.py checks the same). --train trains each named line (default: all
that resolve) for 2 steps under torchrun on CPU with gloo, on the fewest ranks its layout
needs (at most --max-ranks, default 8: every resolving line), and prints a markdown table (case,
ranks, outcome, last loss); each launch's whole output is kept in --log-dir (runs/megatron_lm_corpus).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMIT = "f8837c04ef6cbef6cdefb8de001aad63178aebbf"
CASES_DIR = "tests/functional_tests/test_cases/moe"
ASSET = os.path.join(ROOT, "tests", "assets", "megatron_lm_corpus.json")
WORLD_SIZE = 8
"""The functional tests' GPU count: the world size the lines are resolved at."""

SHRINK = {
    "--hidden-size": 64, "--num-attention-heads": 8, "--kv-channels": 8,
    "--ffn-hidden-size": 128, "--moe-ffn-hidden-size": 32,
    "--moe-shared-expert-intermediate-size": 32, "--q-lora-rank": 32, "--kv-lora-rank": 16,
    "--qk-head-dim": 8, "--qk-pos-emb-head-dim": 8, "--v-head-dim": 8,
    "--num-experts": 16, "--seq-length": 64, "--max-position-embeddings": 64,
    "--micro-batch-size": 1, "--global-batch-size": 8, "--train-iters": 2,
    "--train-samples": 16, "--eval-iters": 1,
}
"""The one size rule: each flag's value becomes min(value, this). Layers are kept (the lines'
--moe-layer-freq lists and pipeline layouts name them); widths become a tiny model's (head
dim 8); at most 16 experts (the group-limited lines route top-6 within 2 of 4 groups, so
16 is the fewest that keep that routing possible); sequence 64; micro batch 1, global batch
8 (divisible by every data-parallel size at 8 ranks); 2 steps (2 x 8 samples); 1 eval
batch. Schedules (--lr-decay-iters, warmup) and every other flag are kept."""

PLACEHOLDER = re.compile(r"\$\{[A-Z_]+\}")
DATA_FLAGS = ("--data-path", "--vocab-file", "--merge-file", "--tokenizer-type",
              "--tokenizer-model", "--data-cache-path", "--split", "--mock-data",
              "--vocab-size")
PATH_FLAGS = {"--save": "checkpoints", "--load": "checkpoints", "--tensorboard-dir": "tb"}
"""One scratch checkpoint directory for --save and --load: a fresh job (the tests' load path
holds an earlier run's checkpoint on their machines; here there is none)."""
MOCK_DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512"]


def _shrunk(flag: str, value):
    if flag in SHRINK and not isinstance(value, bool):
        return min(type(SHRINK[flag])(float(value)), SHRINK[flag])
    return value


MAX_RANKS = 8
"""--train's default --max-ranks: every resolving line's layout fits
(test_megatron_lm_corpus.py::test_every_resolving_line_trains_within_the_default_max_ranks)."""

BRACKETED = re.compile(r"^\[[^]]+\]$")


def launcher_words(value) -> List[str]:
    """The words Megatron-LM's launcher makes of a MODEL_ARGS value: a string wrapped in
    brackets (`"[layernorm mlp moe_act]"`) loses them and is split on whitespace, so
    `--recompute-modules` gets one module per word (core_r0.19.0
    tests/functional_tests/shell_test_utils/_run_training.sh: "Case: value is wrapped in
    [ ]" strips them with sed and appends the value unquoted to the string that
    `eval "TRAINING_PARAMS_ARRAY=(...)"` splits); any other value stays one word."""
    text = str(value).strip()
    return text[1:-1].split() if BRACKETED.match(text) else [str(value)]


def line_from_config(text: str) -> List[str]:
    """MODEL_ARGS of a model_config.yaml as a command line, shrunk by SHRINK."""
    import yaml

    line: List[str] = []
    for flag, value in yaml.safe_load(text)["MODEL_ARGS"].items():
        if value is True:
            line.append(flag)
        elif value is not False:
            values = value if isinstance(value, list) else launcher_words(value)
            line += [flag, *(PLACEHOLDER.sub(lambda m: m.group(0)[2:-1],
                                             str(_shrunk(flag, v))) for v in values)]
    return line


def _git(mirror: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", mirror, *args], check=True,
                          capture_output=True, text=True).stdout


def generate(mirror: str) -> dict:
    names = _git(mirror, "ls-tree", "--name-only", f"{COMMIT}:{CASES_DIR}").split()
    cases = {name: line_from_config(_git(mirror, "show",
                                         f"{COMMIT}:{CASES_DIR}/{name}/model_config.yaml"))
             for name in names}
    return {"source": f"NVIDIA/Megatron-LM {COMMIT} {CASES_DIR}/*/model_config.yaml "
                      "MODEL_ARGS", "generator": "tools/megatron_lm_corpus.py --generate",
            "shrink": SHRINK, "cases": cases}


def corpus_text(corpus: dict) -> str:
    """JSON with one line per case (a diff shows which line changed)."""
    head = {k: v for k, v in corpus.items() if k != "cases"}
    cases = ",\n".join(f" {json.dumps(name)}: {json.dumps(line)}"
                        for name, line in corpus["cases"].items())
    return json.dumps(head, indent=1)[:-2] + ',\n "cases": {\n' + cases + "\n }\n}\n"


def load_cases() -> Dict[str, List[str]]:
    with open(ASSET) as fh:
        return json.load(fh)["cases"]


def runnable_line(line: List[str], scratch: str) -> List[str]:
    """The line with its data/tokenizer flags replaced by mock data and its paths by
    `scratch` (the module docstring)."""
    out: List[str] = []
    i = 0
    while i < len(line):
        flag = line[i]
        j = i + 1
        while j < len(line) and not line[j].startswith("--"):
            j += 1
        if flag in PATH_FLAGS:
            out += [flag, os.path.join(scratch, PATH_FLAGS[flag])]
        elif flag not in DATA_FLAGS:
            out += line[i:j]
        i = j
    return out + MOCK_DATA


# A refusal's reason, by what it names (first match): what this CPU platform cannot run or
# what this trainer does not build; counted in docs/megatron_lm.md. CUDA graphs come before
# inference: Megatron-LM files --cuda-graph-modules under its inference arguments, so its
# refusal says "inference serving", but the scoped-CUDA-graph lines are pretraining.
REASONS = (
    ("CUDA graphs / GPU streams / offloading", (
        "cuda-graph", "cuda graph", "CUDA", "offload", "--delay-wgrad-compute",
        "--overlap-moe-expert")),
    ("GPT-3 architecture (item 2: GeLU / LayerNorm / learned positions / tied)",
     ("--swiglu", "--normalization", "--position-embedding-type", "--untie-embeddings",
      "--disable-bias-linear")),
    ("inference / RL test, not pretraining", (
        "inference", "--rl-", "grpo", "--prompts", "--langrl", "--num-tokens-to-generate",
        "--temperature", "--top_k", "--return-log-probs", "--output-path", "--incoming-requests",
        "--max-tokens-to-oom", "--prompt-file", "--flash-decode", "--enable-chunked-prefill",
        "--perform-rl-step", "--use-checkpoint-args", "--tiktoken-pattern",
        "--no-use-tokenizer-model-from-checkpoint-args", "--empty-unused-memory-level",
        "--moe-enable-routing-replay",
        "--suspend-")),  # --suspend-resume-interval/-timeout: the dynamic-inference engine's
    ("FP8 / TransformerEngine", ("fp8", "FP8", "TransformerEngine", "--te-", "--fp4",
                                 "--use-transformer-engine-op-fuser",
                                 "--first-last-layers-bf16")),  # FP8's bf16 ends
    ("DeepEP / HybridEP", ("DeepEP", "flex")),
    ("Megatron-FSDP precision options (--megatron-fsdp-*-dtype; FSDP itself trains and "
     "saves)", ("fsdp", "FSDP", "--outer-dp-sharding", "--data-parallel-sharding")),
    ("checkpoint integrity / async strategy", (
        "--verify-integrity", "--async-strategy", "--async-ckpt-use-cpu-shm",
        "--check-weight-hash")),
)


def reason_of(refusal: str) -> str:
    for reason, marks in REASONS:
        if any(mark in refusal for mark in marks):
            return reason
    return "other: " + refusal.split(":")[0]


def resolve(line: List[str], parser=None) -> Tuple[Optional[object], List[str]]:
    """(run config, []) or (None, the refusal lines) for a corpus line at WORLD_SIZE 8
    (`parser`: flags.build_parser()'s, built once for many lines)."""
    from megatron_mvmoe.config.flags import config_from_args

    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK")}
    os.environ.update(WORLD_SIZE=str(WORLD_SIZE), RANK="1")  # RANK 1: no start-up notes
    try:
        return config_from_args(runnable_line(line, "/nonexistent"), parser), []
    except ValueError as err:
        lines = str(err).splitlines()
        return None, [x.strip() for x in (lines[1:] if lines[0].endswith("refused:")
                                          else lines)]
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ranks_needed(run) -> int:
    """The fewest ranks the run's layout runs on (ParallelLayout.smallest_world_size: EP x ETP
    dividing TP x CP x DP, the distributed-optimizer instances dividing both data-parallel
    sizes, as Megatron-Core asserts)."""
    return run.parallel.smallest_world_size()


def resolve_all(cases: Dict[str, List[str]]) -> dict:
    from megatron_mvmoe.config.flags import build_parser

    outcome, parser = {}, build_parser()
    for name, line in cases.items():
        run, refusals = resolve(line, parser)
        outcome[name] = {"resolves": run is not None, "refusals": refusals,
                         "reasons": sorted({reason_of(r) for r in refusals}),
                         "ranks": ranks_needed(run) if run is not None else None}
    return outcome


def train_one(name: str, line: List[str], ranks: int, timeout: float,
              log_dir: Optional[str] = None) -> dict:
    """Train one line 2 steps under torchrun; the row of the table, and with `log_dir` the
    launch's whole output kept in <log_dir>/<case>.log (a failure's row holds one line)."""
    from megatron_mvmoe.launch.local_ranks import free_port

    with tempfile.TemporaryDirectory(prefix=f"corpus_{name[:20]}_") as scratch:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
               "--master_port", str(free_port()), "-m", "megatron_mvmoe.training.pretrain",
               *runnable_line(line, scratch)]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        start = time.time()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=timeout, cwd=scratch)
            out, rc = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as stopped:
            out, rc = _text(stopped.stdout) + _text(stopped.stderr), "timeout"
    log = _keep_log(log_dir, name, out)
    losses = re.findall(r"\bloss[ =:]+([0-9.]+(?:e[-+]?\d+)?)", out)
    errors = [x for x in out.splitlines() if x.startswith("error")] or \
        [x for x in out.splitlines() if "Error" in x]
    return {"case": name, "ranks": ranks, "rc": rc, "seconds": round(time.time() - start),
            "last_loss": losses[-1] if losses else None,
            "error": errors[-1][:160] if rc != 0 and errors else None,
            **({"log": log} if log else {})}


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def _keep_log(log_dir: Optional[str], name: str, out: str) -> Optional[str]:
    if not log_dir:
        return None
    os.makedirs(log_dir, exist_ok=True)
    path = os.path.join(log_dir, f"{name}.log")
    with open(path, "w") as f:
        f.write(out)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generate", action="store_true")
    parser.add_argument("--check", action="store_true", help="with --generate: exit 1 if "
                        "the committed corpus differs from a fresh one")
    parser.add_argument("--mirror", default="/work/.mirror/NVIDIA+Megatron-LM/repo")
    parser.add_argument("--resolve", action="store_true")
    parser.add_argument("--train", nargs="*", metavar="CASE")
    parser.add_argument("--max-ranks", type=int, default=MAX_RANKS)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--log-dir", default=os.path.join("runs", "megatron_lm_corpus"),
                        help="with --train: each line's whole launch output is kept in "
                        "DIR/<case>.log (default: %(default)s, git-ignored)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.generate:
        if not os.path.isdir(args.mirror):
            print(f"error: --mirror {args.mirror}: not a directory. Fix: pass the git "
                  f"directory of a NVIDIA/Megatron-LM clone holding {COMMIT[:8]}",
                  file=sys.stderr)
            return 2
        text = corpus_text(generate(args.mirror))
        if args.check:
            same = os.path.isfile(ASSET) and open(ASSET).read() == text
            print("corpus up to date" if same else "corpus differs: rerun without --check")
            return 0 if same else 1
        with open(ASSET, "w") as fh:
            fh.write(text)
        print(f"{len(json.loads(text)['cases'])} lines -> {os.path.relpath(ASSET, ROOT)}")
        return 0
    cases = load_cases()
    if args.resolve or args.train is None:
        return _print_resolve(resolve_all(cases), args.json)
    outcome = resolve_all({n: cases[n] for n in (args.train or cases)})
    rows = []
    for name, result in outcome.items():
        if not result["resolves"]:
            rows.append({"case": name, "ranks": None, "rc": "refused",
                         "error": "; ".join(result["reasons"])})
        elif result["ranks"] > args.max_ranks:
            rows.append({"case": name, "ranks": result["ranks"], "rc": "skipped",
                         "error": f"needs {result['ranks']} ranks > --max-ranks"})
        else:
            rows.append(train_one(name, cases[name], result["ranks"], args.timeout,
                                  args.log_dir))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print("| case | ranks | outcome | last loss printed | s |\n|---|---|---|---|---|")
        for row in rows:
            result = "trained 2 steps" if row["rc"] == 0 else f"{row['rc']}: {row.get('error')}"
            print(f"| {row['case']} | {row['ranks']} | {result} | {row.get('last_loss')} | "
                  f"{row.get('seconds', '')} |")
    return 0 if all(r["rc"] in (0, "refused", "skipped") for r in rows) else 1


def _print_resolve(outcome: dict, as_json: bool) -> int:
    counts = Counter(reason for r in outcome.values() for reason in r["reasons"])
    resolved = sum(r["resolves"] for r in outcome.values())
    if as_json:
        print(json.dumps({"resolves": resolved, "refused": len(outcome) - resolved,
                          "reasons": counts, "cases": outcome}, indent=1))
        return 0
    for name, r in outcome.items():
        print(f"{name}: " + (f"resolves ({r['ranks']} ranks)" if r["resolves"] else
                             "refused: " + " | ".join(r["refusals"])))
    print(f"\n{resolved} of {len(outcome)} resolve; refused lines by reason: "
          + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
