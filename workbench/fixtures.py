"""Fixture candidates of a task: ``fixtures/good/*`` must be accepted, ``fixtures/bad/<guard>-*``
must be rejected by the guard their name starts with.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from workbench.taskspec import TaskSpec

GUARD_NAMES = ("isolation", "audit", "correctness", "activation", "model_eval", "perf")


@dataclasses.dataclass(frozen=True)
class Fixture:
    """One fixture candidate.

    Attributes:
        name: file or folder name without ``.patch``.
        path: the patch file or overlay folder.
        good: True under ``fixtures/good``.
        expected_guard: for bad fixtures, the guard that must reject it (prefix of the name).
    """

    name: str
    path: Path
    good: bool
    expected_guard: str | None


def list_fixtures(task: TaskSpec) -> list[Fixture]:
    """Every fixture of the task, good first, sorted by name.

    Raises:
        ValueError: a bad fixture's name does not start with a known guard name.
    """
    out = []
    for kind in ("good", "bad"):
        d = Path(task.root) / "fixtures" / kind
        if not d.is_dir():
            continue
        for p in sorted(d.iterdir()):
            if p.name.startswith(".") or not (p.is_dir() or p.suffix == ".patch"):
                continue
            name = p.name.removesuffix(".patch")
            guard = None
            if kind == "bad":
                guard = next((g for g in GUARD_NAMES if name.startswith(g + "-")), None)
                if guard is None:
                    raise ValueError(
                        f"Task {task.task_id!r}: bad fixture {p.name!r} must start with the guard that rejects "
                        f"it ({', '.join(GUARD_NAMES)}) followed by '-'; rename it."
                    )
            out.append(Fixture(name, p, kind == "good", guard))
    return out


def fixture_outcome_ok(fx: Fixture, accepted: bool, rejecting_guard: str | None) -> bool:
    """Whether a judged fixture came out as its folder and name say."""
    return accepted if fx.good else (not accepted and rejecting_guard == fx.expected_guard)
