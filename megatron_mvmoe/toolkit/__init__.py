"""The one front door for tools: everything a command line needs to open a run or a
checkpoint, below `analysis/` and outside `training/`.

- `checkpoint`: a run config (a checkpoint's stored one, a YAML file or a preset) -> the
  run's model on this rank (`models/build.build_model` + `checkpointing/weights.load_weights`,
  no DDP or optimizer), the tool's process-group session and the run's tokenizer;
- `flags`: the shared flags (`--load` + layout + tokenizer, `--set`, held-out data, `--json`)
  and the parser every tool uses (whole docstring as --help, one-line errors);
- `specs`: `--model` specs (preset | run.yaml | checkpoint dir) opened on one gloo rank;
- `heldout`: held-out batches and per-token NLL for the analyses;
- `generation`: greedy / top-p text generation;
- `output`: JSON or text on stdout, atomic JSON files.

It imports neither `training` nor `analysis` (tests/test_dependency_rules.py); the tools,
analysis, hf/ and evaluation/ build on it.
"""
