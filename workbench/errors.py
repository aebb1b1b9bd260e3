"""Typed errors of the workbench's own machinery (bad input, broken infrastructure).

A bad *candidate* is never an exception: it is a FAIL verdict. These errors mean the workbench cannot
judge at all; the CLI turns them into one clear line and exit code 2.
"""

from __future__ import annotations


class WorkbenchError(Exception):
    """Base class: the message is a full sentence (subject, location, expected, got, fix)."""


class TaskSpecError(WorkbenchError):
    """A task folder (``tasks/<task_id>/``) is missing, malformed or inconsistent."""


class CandidateError(WorkbenchError):
    """A candidate (patch, folder or branch) cannot be found or applied to the base commit."""


class RepoError(WorkbenchError):
    """The repository, base commit or worktree area is not usable."""


class ChildProcessError_(WorkbenchError):
    """The sandboxed child that runs candidate code could not be started or read back."""


class AgentError(WorkbenchError):
    """An agent backend cannot run (no API key, the API failing after retries, a command that cannot start)."""


class Interrupted(KeyboardInterrupt):
    """The user pressed Ctrl-C (SIGINT) while the workbench judged or ran an agent.

    Raised after every child process group was killed and the half-made state was cleaned up (or kept
    on purpose); ``note`` says which, in one sentence. The CLI prints it and exits 130 (128 + SIGINT).
    """

    def __init__(self, note: str) -> None:
        super().__init__(note)
        self.note = note
