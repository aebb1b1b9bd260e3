"""The tree the judge's children import candidate code from: a plain checkout, not the workbench's worktree.

A candidate's worktree (``.workbench/worktrees/<task>-<n>/``, a git worktree whose ``.git`` is a file)
differs from every place the merged kernel later runs: a checkout of main (``.git`` a folder), an
installed package. Candidate code that looks at its own path or at its checkout's shape could behave
only when judged (session 10's red team: "is ``.git`` a file?" written without the literal passed
every guard but perf). So every child that runs candidate code imports from a clone of the candidate
commit instead: ``.git`` a folder with ``HEAD`` on ``main``, in a folder named as the maintainer's
checkout, under a fresh temporary folder (the path of a serving checkout is the operator's choice, so
nothing in it can mark the judge). The isolation guard and the audit read the worktree as before.

What stays visible, and why it is not worth closing: the clone's ``.git`` internals (its remote, the
``alternates`` file that shares the objects; the child's runtime hooks refuse reading them) and the
absence of a ``.git/worktrees`` folder, which a fresh clone of main shares.

Source: DESIGN.md "Trust model" (a kernel must not recognise the judge); session 10's red team.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

BRANCH = "main"
"""The branch the clone's ``HEAD`` names, as in the maintainer's checkout."""


@contextlib.contextmanager
def judged_tree(worktree: Path, commit: str, name: str) -> Iterator[Path]:
    """A clone of ``commit`` for the judge's children, removed at the end of the block.

    Args:
        worktree: the candidate's worktree (any checkout holding ``commit``).
        commit: the candidate commit (full SHA).
        name: the folder name of the clone (the maintainer's checkout's name).

    Yields:
        The clone's root: readable by every user (children run as a fresh uid where they can).

    Raises:
        RuntimeError: git could not clone or check out the commit (the message has git's reason).
    """
    tmp = Path(tempfile.mkdtemp())
    try:
        os.chmod(tmp, 0o755)  # the child's uid must reach it
        dest = tmp / name
        env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}
        for cmd in (["git", "clone", "-q", "--shared", "--no-checkout", str(worktree), str(dest)],
                    ["git", "-C", str(dest), "checkout", "-q", "-B", BRANCH, commit]):
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if done.returncode != 0:
                raise RuntimeError(f"Making the judged tree failed: {' '.join(cmd[:3])} ...: "
                                   f"{(done.stderr or done.stdout).strip()[:500]}")
        subprocess.run(["git", "-C", str(dest), "remote", "remove", "origin"], capture_output=True, check=False)
        yield dest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
