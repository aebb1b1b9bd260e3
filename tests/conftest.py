"""Shared fixtures: a throwaway git copy of the project, so runs never touch the real .workbench/."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
_IGNORE = shutil.ignore_patterns(".git", ".workbench", "__pycache__", ".pytest_cache", "*.egg-info", ".device",
                                 ".gpuwork", ".hypothesis", "build", ".whl", ".gl")
GIT_ENV = {"GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@localhost",
           "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@localhost"}


def git(cwd: Path, *args: str) -> str:
    """Run git in ``cwd`` with a fixed identity; return stdout."""
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout.strip()


def make_project_copy(dest: Path) -> Path:
    """Copy the current working tree (committed or not) into ``dest`` as a fresh one-commit repo."""
    shutil.copytree(REPO_ROOT, dest, ignore=_IGNORE, symlinks=True)
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-qm", "base")
    return dest


@pytest.fixture(scope="session")
def project_repo(tmp_path_factory) -> Path:
    """A session-wide git copy of the project (runs write their .workbench/ there)."""
    return make_project_copy(tmp_path_factory.mktemp("project") / "repo")


@pytest.fixture
def fresh_repo(tmp_path) -> Path:
    """A git copy of the project for tests that change branches or history."""
    return make_project_copy(tmp_path / "repo")
