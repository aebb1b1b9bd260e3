"""Helpers shared by the review tests (a uniquely named module: ``conftest`` is not importable safely)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
from pathlib import Path

REVIEWER = "Test Reviewer"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@localhost"}


def git(root: Path, *args: str) -> str:
    """Run git in ``root`` and return stdout (raises on a non-zero exit)."""
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout.strip()


@dataclasses.dataclass
class Repo:
    """A test repository: ``root`` (``main`` checked out), the accepted and rejected result files."""

    root: Path
    accepted: Path
    rejected: Path

    def store(self):
        from workbench.review.service import open_store

        return open_store(self.root)
