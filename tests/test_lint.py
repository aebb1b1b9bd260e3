"""The repository is ruff-clean under pyproject.toml's [tool.ruff] (hostile fixture folders excluded there)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


def test_ruff_check_is_clean():
    ruff = pytest.importorskip("ruff", reason="ruff is not installed (pip install -e '.[test]' brings it)")
    exe = ruff.find_ruff_bin() if hasattr(ruff, "find_ruff_bin") else "ruff"
    out = subprocess.run([exe, "check", "--no-cache", "--output-format", "concise", "."], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "All checks passed!" in out.stdout, sys.executable
