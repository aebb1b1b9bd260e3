"""Shared fixtures: a throwaway git copy of the project, so runs never touch the real .workbench/."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterator
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


# ---- a quiet machine for tests that judge a speedup ------------------------------------------------
#
# Under pytest-xdist the workers share the machine's cores. A test marked ``quiet`` asserts a perf
# verdict measured on CPU (an honest candidate's real gain); a second worker running beside it skews
# those timings, so it runs alone: a readers-writer lock across the workers, with a turnstile so the
# quiet test is not starved. Every other test holds the lock shared while it runs.


def _shared_dir(factory: pytest.TempPathFactory) -> Path:
    base = factory.getbasetemp()
    d = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "machine-locks"
    d.mkdir(parents=True, exist_ok=True)
    return d


@contextlib.contextmanager
def _machine(d: Path, *, alone: bool) -> Iterator[None]:
    with open(d / "turnstile", "a+") as turnstile, open(d / "machine", "a+") as machine:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        if alone:  # keep the turnstile shut: tests that start now wait until this one ends
            fcntl.flock(machine, fcntl.LOCK_EX)
        else:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
            fcntl.flock(machine, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(machine, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(turnstile, fcntl.LOCK_UN)


def quiet_machine(factory: pytest.TempPathFactory):
    """The machine to oneself, for a session fixture that judges a speedup (a context manager; a no-op
    without pytest-xdist). Session fixtures are set up before the test's own lock is taken."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return contextlib.nullcontext()
    return _machine(_shared_dir(factory), alone=True)


@pytest.fixture(autouse=True)
def _quiet_when_timing(request, tmp_path_factory) -> Iterator[None]:
    """Run a ``quiet`` test while no other test of this session runs (only under pytest-xdist)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    with _machine(_shared_dir(tmp_path_factory), alone=request.node.get_closest_marker("quiet") is not None):
        yield


def pytest_collection_modifyitems(config, items):
    """``gpu`` tests skip by themselves on a machine without CUDA (the reason says so)."""
    gpu = [it for it in items if it.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu); none is visible here")
        for it in gpu:
            it.add_marker(skip)
