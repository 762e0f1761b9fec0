"""Reading a megatron_mvmoe checkpoint without a trainer: the on-disk format, finding and
verifying a checkpoint directory, the model fingerprint, and the model weights.

Modules (imported explicitly; this package imports nothing on its own):
- errors.py       CheckpointError: what is wrong with a checkpoint and the fix
- directory.py    the layout of a checkpoint root (`latest`, iter_<step>/, run_state.json),
                  `resolve_checkpoint`, `read_run_state`, `verify_checkpoint` (manifests)
- integrity.py    manifests (sizes + SHA-256), retention, disk full
- publish.py      a finished save put in place (`publish`) and an interrupted one
                  finished or undone at start-up (`recover`)
- fingerprint.py  what a model is made of, compared before any tensor is read
- weights.py      `load_weights`: a checkpoint's model weights into unwrapped GPTModel chunks

The trainer (`training/checkpoint.py`) writes checkpoints and restores the optimizer,
scheduler and RNG on top of this; the analysis and inference tools need only this package
(with `models/build.build_model`). Layering: imports platform, models, Megatron and torch;
never training or analysis.
"""
