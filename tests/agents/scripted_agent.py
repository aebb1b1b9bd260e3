"""A scripted stand-in for a CLI coding agent (used by tests/agents and usable by hand).

Usage: python scripted_agent.py FEEDBACK_FILE [ENV_DUMP]

Run in the worktree. With no feedback (attempt 1) it writes a kernel that is wrong at batch 33 (the
bad fixture ``correctness-wrong-at-batch-33``); once the feedback file exists and names a rejection,
it writes the good fixture's kernel. With ENV_DUMP it also writes the names of the variables it was
given to that file (JSON), so tests can check the command backend's allowlist.
"""

import json
import os
import shutil
import sys
from pathlib import Path

FIXTURES = Path("tasks/k3_moe_dispatch/fixtures")
TARGET = Path("k3_model/kernels/moe_dispatch/__init__.py")


def main() -> int:
    feedback = Path(sys.argv[1]) if len(sys.argv) > 1 and sys.argv[1] else None
    if len(sys.argv) > 2:
        Path(sys.argv[2]).write_text(json.dumps({"names": sorted(os.environ), "home": os.environ.get("HOME"),
                                                 "key": os.environ.get("ANTHROPIC_API_KEY")}))
    rejected = feedback is not None and feedback.is_file() and "REJECTED" in feedback.read_text()
    src = FIXTURES / ("good/lean-torch-cpu" if rejected else "bad/correctness-wrong-at-batch-33") / TARGET
    TARGET.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, TARGET)
    print(f"scripted agent: wrote {TARGET} from {src.parts[-6]}/{src.parts[-5]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
