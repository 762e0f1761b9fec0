"""megatron_mvmoe.launch.torchrun's one patch: on this torch a worker failure stops the
other workers with torchrun's fixed 30 s grace; patched, a `close()` without a timeout
uses TORCH_ELASTIC_SHUTDOWN_TIMEOUT (main() sets it from --shutdown-timeout). The first
test fails once a torch release honours the timeout itself: drop the patch then. The
end-to-end check is tests/training/test_dead_rank.py's hung rank (job end time)."""

import inspect
import re
import subprocess
import sys
from datetime import datetime

from torch.distributed.elastic.multiprocessing.api import SubprocessContext

from megatron_mvmoe.launch import torchrun

FAILS_WHILE_ONE_HANGS = """
import os, signal, sys, time
if os.environ["RANK"] == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a rank that does not act on SIGTERM
    time.sleep(600)
time.sleep(1)
sys.exit(1)
"""


def test_this_torch_still_needs_the_patch():
    assert torchrun.patch_status() in ("needed", "applied"), (
        "torch now honours --shutdown-timeout when a worker fails: remove "
        "megatron_mvmoe/launch/torchrun.py and launch torch.distributed.run directly")
    assert "self.close()" in inspect.getsource(SubprocessContext._poll)


def test_a_failed_worker_stops_the_others_within_the_chosen_grace(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(FAILS_WHILE_ONE_HANGS)
    grace_s = 2
    proc = subprocess.run([sys.executable, "-m", "megatron_mvmoe.launch.torchrun",
                           "--standalone", "--nproc_per_node", "2", "--shutdown-timeout",
                           str(grace_s), str(script)], capture_output=True, text=True,
                          timeout=120, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1, proc.stderr[-2000:]
    sigterm, sigkill = (_logged_at(proc.stderr, text) for text in (
        "closing signal SIGTERM", "forcefully exiting via 9"))
    print(f"hung rank: SIGKILL {sigkill - sigterm:.2f} s after SIGTERM (grace {grace_s} s; "
          f"torchrun's own: {torchrun.TORCH_DEFAULT_S} s)")
    assert grace_s - 0.5 <= sigkill - sigterm <= grace_s + 3


def _logged_at(log: str, text: str) -> float:
    """Seconds of the day of torch's log line containing `text` ("W1202 14:16:10.239000")."""
    line = next((l for l in log.splitlines() if text in l), None)
    assert line is not None, f"no {text!r} in:\n{log[-2000:]}"
    stamp = re.search(r"\d\d:\d\d:\d\d\.\d+", line).group(0)
    t = datetime.strptime(stamp, "%H:%M:%S.%f")
    return t.hour * 3600 + t.minute * 60 + t.second + t.microsecond / 1e6
