"""The guard protocol and the context every guard reads.

Source: DESIGN.md "Contracts" (Guard: ``check(ctx) -> Verdict``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Protocol

from guards.artifacts import Artifacts
from guards.verdict import Verdict
from workbench.taskspec import TaskSpec


@dataclasses.dataclass
class GuardContext:
    """What a guard may look at.

    Attributes:
        task: the task spec, loaded from the workbench's own checkout.
        repo_root: the workbench's own checkout (trusted code: tasks, references, guards).
        worktree: the candidate's checkout (untrusted: only child processes import from it).
        base_commit, candidate_commit: full SHAs; the diff between them is the candidate.
        device: ``cpu`` or ``cuda``.
        seed: the run-time seed (never shown to the candidate).
        artifacts: data guards hand on to later guards and to the result file (typed fields,
            :class:`guards.artifacts.Artifacts`; inside ``run_guards`` each guard sees a view limited
            to what it declares in ``reads``/``writes``).
        judged_tree: where the children import the candidate from (``None``: the worktree). Inside
            ``run_guards`` it is a plain clone of the candidate commit (:func:`guards.judged_tree.judged_tree`),
            so candidate code cannot tell the judge's child from a checkout of main by its own path
            or its checkout's shape.
    """

    task: TaskSpec
    repo_root: Path
    worktree: Path
    base_commit: str
    candidate_commit: str
    device: str
    seed: int
    artifacts: Artifacts = dataclasses.field(default_factory=Artifacts)
    judged_tree: Path | None = None

    @property
    def child_root(self) -> Path:
        """The tree every child that runs candidate code imports from (:attr:`judged_tree` or the worktree)."""
        return self.judged_tree or self.worktree


class Guard(Protocol):
    """One check of a candidate. Returns FAIL (with evidence) for a bad candidate; raises only when
    the guard itself cannot work (the pipeline records that as ERROR)."""

    name: str
    reads: tuple[str, ...]
    """Artifacts (:class:`guards.artifacts.Artifacts` fields) this guard reads from earlier guards."""
    writes: tuple[str, ...]
    """Artifacts this guard writes (each field has one writer)."""

    def check(self, ctx: GuardContext) -> Verdict: ...
