"""The resident set of this process as the kernel counts it (/proc/self/status): current,
high-water mark (VmHWM) and its reset, and what the node can still hand out. The memory
census (training/memory_report.py) and the collective probe (collective_memory.py) read
memory through these, not torch's allocator: on CPU what runs out is resident memory."""

from __future__ import annotations

import re
from typing import Optional


def _status_kib(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as fh:
            match = re.search(rf"^{key}:\s+(\d+) kB", fh.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def rss_bytes() -> int:
    kib = _status_kib("VmRSS")
    return 0 if kib is None else kib * 1024


def peak_rss_bytes() -> int:
    kib = _status_kib("VmHWM")
    return 0 if kib is None else kib * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current resident set (Linux >= 4.0); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (what the kernel can hand out without swapping)."""
    with open("/proc/meminfo") as fh:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", fh.read(), re.MULTILINE)
    return int(match.group(1)) * 1024
