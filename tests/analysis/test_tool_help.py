"""Every tool's --help shows its whole description (not the first line cut mid-sentence)
and every tool offers --json."""

import re
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"
CUT = re.compile(r"description=__doc__\s*\.\s*(split|splitlines)\(")
# Tools other helpers own while this check was written (issues 14, 15).
OWNED_ELSEWHERE = {"a2a_volume.py", "plan.py"}


def test_no_tool_cuts_its_description():
    cut = [p.name for p in sorted(TOOLS.glob("*.py"))
           if p.name not in OWNED_ELSEWHERE and CUT.search(p.read_text())]
    assert cut == [], f"these tools show only part of their docstring in --help: {cut}"


def test_every_tool_has_json_output():
    missing = [p.name for p in sorted(TOOLS.glob("*.py"))
               if "--json" not in p.read_text()
               # slurm_local.py prints cluster state for shells; slurm_netns.py is its module
               and p.name not in ("slurm_local.py", "slurm_netns.py")]
    assert missing == [], missing
