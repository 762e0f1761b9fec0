"""Resumable run store of tools/compare.py: one JSON file per finished (variant, seed, setup).

Design choices:
- A run is identified by the variant's name and model dict, the seed and the shared setup
  (steps, batch, sequence, LR, data path, eval size); the file name carries a hash of all
  of them, so a changed setup never reuses a stale run and suites that share a variant
  with the same setup (a and c) share its runs.
- Files are written atomically (temporary file + os.replace): a comparison killed at any
  moment leaves only whole runs, and the next invocation trains only what is missing, so
  a 5-seed comparison can span several sessions.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Dict, Mapping, Optional

from megatron_mvmoe.toolkit.output import write_json_atomic


def run_key(variant_name: str, model: Mapping, seed: int, setup: Mapping) -> str:
    """'<variant>_seed<n>_<12 hex digits of the identity hash>'."""
    identity = json.dumps({"variant": variant_name, "model": model, "seed": seed,
                           "setup": setup}, sort_keys=True, default=repr)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    return f"{variant_name}_seed{seed}_{digest}"


class RunStore:
    """Finished runs under `directory`, one `<key>.json` each."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key + ".json")

    def load(self, key: str) -> Optional[Dict]:
        path = self.path(key)
        if not os.path.isfile(path):
            return None
        try:
            with open(path) as fh:
                return json.load(fh)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err}). Fix: delete the file so the "
                             "run is trained again") from err

    def save(self, key: str, run: Mapping) -> str:
        os.makedirs(self.directory, exist_ok=True)
        return write_json_atomic(self.path(key), dict(run))
