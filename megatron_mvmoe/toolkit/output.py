"""What a tool writes: JSON or a human summary on stdout, one-line errors, atomic files."""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, Tuple


def emit(payload: Dict, as_json: bool, text: str) -> None:
    """Print JSON (machine-readable) or the human summary."""
    if as_json:
        json.dump(payload, sys.stdout, indent=2, default=float)
        sys.stdout.write("\n")
    else:
        print(text)


def fail(message: str) -> Tuple[int, None]:
    """Print `error: message` on stderr; (exit status 2, no result)."""
    print(f"error: {message}", file=sys.stderr)
    return 2, None


def write_json_atomic(path: str, payload: Dict) -> str:
    """Write JSON via a temporary file and os.replace: a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(payload, fh, indent=1, default=str)
    os.replace(tmp, path)
    return path
