"""Typed artifacts: what one guard hands on to later guards and to the result file.

Each field has one writer. Each guard class declares the fields it reads and writes
(``reads``/``writes`` class attributes), and :func:`view_for` gives it a view that refuses any other
access, so a guard cannot depend on data it did not declare, and the declarations stay true.

Field owners (``default_guards`` order):

- ``isolation`` writes ``changed_paths``;
- ``correctness`` writes ``scope``, ``scope_verdict``, ``imported_files``, ``tested_tp_sizes``,
  ``cases``, ``traces``, ``case_objects``;
- ``activation`` reads those and ``changed_paths``;
- ``perf`` reads ``scope`` and writes ``perf``.

Source: issue 17 item 4 ("typed guard artifacts: each guard declares what it reads and writes").
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from guards.verdict import Verdict


@dataclasses.dataclass
class Artifacts:
    """The store of one judging. ``None`` means "not written (yet)".

    Attributes:
        changed_paths: repo-relative paths the candidate changes, sorted (isolation).
        scope: the ``SCOPE`` the child read from the candidate's kernel, as plain data (``OpScope.to_dict``
            form, lists for tuples); ``None`` also when no kernel is merged for the op (correctness).
        scope_verdict: the activation verdict found before any configuration ran, when the declared
            scope claims what this run does not test (correctness).
        imported_files: repo-relative files the child imported from the worktree (correctness).
        tested_tp_sizes: TP sizes (world sizes) correctness ran, ascending (correctness).
        cases: one dict per configuration, the result file's ``CaseResult`` fields (correctness).
        traces: configuration name -> per call, the dispatch decisions recorded in the child (correctness).
        case_objects: the configurations themselves (``guards.correctness`` cases; correctness).
        perf: one dict per timed configuration, the result file's ``PerfResult`` fields (perf).
    """

    changed_paths: list[str] | None = None
    scope: dict[str, Any] | None = None
    scope_verdict: Verdict | None = None
    imported_files: list[str] | None = None
    tested_tp_sizes: list[int] | None = None
    cases: list[dict[str, Any]] | None = None
    traces: dict[str, list[list[dict[str, Any]]]] | None = None
    case_objects: list[Any] | None = None
    perf: list[dict[str, Any]] | None = None

    FIELDS: ClassVar[frozenset[str]]


Artifacts.FIELDS = frozenset(f.name for f in dataclasses.fields(Artifacts))


class ArtifactAccessError(AttributeError):
    """A guard read or wrote an artifact it did not declare (a bug in the guard, not in the candidate)."""


class ArtifactView:
    """A guard's window on :class:`Artifacts`: reads of ``reads | writes``, writes of ``writes`` only.

    Raises:
        ArtifactAccessError: on any other field, naming the guard, the field and its declaration.
    """

    __slots__ = ("_store", "_guard", "_reads", "_writes")

    def __init__(self, store: Artifacts, guard: str, reads: frozenset[str], writes: frozenset[str]):
        unknown = (reads | writes) - Artifacts.FIELDS
        if unknown:
            raise ArtifactAccessError(f"guard {guard!r} declares unknown artifact(s) {sorted(unknown)}; "
                                      f"known: {sorted(Artifacts.FIELDS)} (guards/artifacts.py)")
        object.__setattr__(self, "_store", store)
        object.__setattr__(self, "_guard", guard)
        object.__setattr__(self, "_reads", reads | writes)
        object.__setattr__(self, "_writes", writes)

    def __getattr__(self, name: str) -> Any:
        if name not in self._reads:
            raise ArtifactAccessError(f"guard {self._guard!r} reads artifact {name!r} but declares reads "
                                      f"{sorted(self._reads)}: add it to the guard's `reads` (guards/artifacts.py)")
        return getattr(self._store, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._writes:
            raise ArtifactAccessError(f"guard {self._guard!r} writes artifact {name!r} but declares writes "
                                      f"{sorted(self._writes)}: add it to the guard's `writes` (guards/artifacts.py)")
        setattr(self._store, name, value)


def declared(guard: object) -> tuple[frozenset[str], frozenset[str]]:
    """``(reads, writes)`` a guard declares (its ``reads``/``writes`` class attributes; empty if absent)."""
    return frozenset(getattr(guard, "reads", ())), frozenset(getattr(guard, "writes", ()))


def view_for(store: Artifacts, guard: object) -> ArtifactView:
    """The view of ``store`` that ``guard`` (an object with ``name``, ``reads``, ``writes``) may use."""
    reads, writes = declared(guard)
    return ArtifactView(store, getattr(guard, "name", type(guard).__name__), reads, writes)
