"""Every command's --help reads whole in an 80-column log (helper-25, session 22: `run --help` cut
the name of the vLLM model-eval environment variable with an ellipsis)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

COMMANDS = ["", "run", "agent", "verify", "clean", "report", "compare", "tasks", "demo", "selftest", "check", "bench",
            "bench-model", "ui", "review", "review list", "review show", "review approve", "review reject"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_no_cut_words_at_80_columns(command):
    env = {**os.environ, "COLUMNS": "80", "TERM": "dumb"}
    out = subprocess.run([sys.executable, "-m", "workbench", *command.split(), "--help"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Usage:" in out.stdout and "…" not in out.stdout, out.stdout
