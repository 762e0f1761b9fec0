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
    # a tool that is a front door to a package CLI: its parser lives there
    front_doors = {"slurm_local.py": TOOLS.parent / "megatron_mvmoe" / "dev_cluster" / "cli.py"}
    missing = [p.name for p in sorted(TOOLS.glob("*.py"))
               if "--json" not in front_doors.get(p.name, p).read_text()]
    assert missing == [], missing
