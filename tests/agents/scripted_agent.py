"""A scripted stand-in for a CLI coding agent (used by tests/agents and usable by hand).

Usage: python scripted_agent.py FEEDBACK_FILE [ENV_DUMP]

Run in the worktree, as the command backend starts it. It works as a shell agent would, from what the
workbench gives it:

1. it reads the brief (``$WORKBENCH_BRIEF``) for the file to write (the task's allowed path) and the
   self-check command;
2. with no feedback (attempt 1) it writes a kernel that is wrong at batch 33 (the bad fixture
   ``correctness-wrong-at-batch-33``: a planted first failure); once the feedback names a rejection, it
   reads the failing configurations from it and writes the good fixture's kernel;
3. it runs the brief's self-check (``--no-perf``: the judging run times) and keeps what it printed.

It writes ``agent-notes-<attempt>.json`` into ``$HOME`` (the agent's home, outside the worktree): the
path it wrote, the configurations it read from the feedback, and the self-check's exit code and output.
With ENV_DUMP it also writes the names of the variables it was given to that file (JSON), so tests can
check the command backend's allowlist.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

FIXTURES = Path("tasks/k3_moe_dispatch/fixtures")


def _from_brief(brief: str) -> tuple[Path, list[str] | None]:
    """The kernel file (the allowed path's folder + ``__init__.py``) and the self-check command."""
    allowed = re.search(r"`(k3_model/kernels/[\w/]+)/\*\*`", brief)
    target = Path(allowed.group(1)) / "__init__.py" if allowed else Path("k3_model/kernels/moe_dispatch/__init__.py")
    check = re.search(r"^workbench check (\S+) --base ([0-9a-f]{40})$", brief, re.M)
    cmd = [sys.executable, "-m", "workbench", "check", check.group(1), "--base", check.group(2)] if check else None
    return target, cmd


def main() -> int:
    feedback = Path(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] else None
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(json.dumps({"names": sorted(os.environ), "home": os.environ.get("HOME"),
                                                 "key": os.environ.get("ANTHROPIC_API_KEY")}))
    brief_path = os.environ.get("WORKBENCH_BRIEF")
    brief = Path(brief_path).read_text() if brief_path and Path(brief_path).is_file() else ""
    target, check = _from_brief(brief)
    text = feedback.read_text() if feedback is not None and feedback.is_file() else ""
    rejected = "REJECTED" in text
    failing = sorted(set(re.findall(r"`(\w+)` \(\w+=\d+", text)))  # configurations: `name` (axis=value, ...
    src = FIXTURES / ("good/lean-torch-cpu" if rejected else "bad/correctness-wrong-at-batch-33") / target
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, target)
    print(f"scripted agent: wrote {target} from {src.parts[-6]}/{src.parts[-5]}"
          + (f" after the feedback named {', '.join(failing)}" if failing else ""))
    notes = {"target": str(target), "feedback_configurations": failing, "self_check": None}
    if check is not None and brief:
        proc = subprocess.run([*check, "--no-perf"], capture_output=True, text=True, timeout=600)
        notes["self_check"] = {"command": shlex.join(check), "exit_code": proc.returncode, "stdout": proc.stdout}
        print(f"scripted agent: self-check exit {proc.returncode}")
    home = os.environ.get("HOME")
    if home:
        attempt = os.environ.get("WORKBENCH_ATTEMPT", "0")
        Path(home, f"agent-notes-{attempt}.json").write_text(json.dumps(notes, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
