"""Fixture candidates of a task: ``fixtures/good/*`` must be accepted, ``fixtures/bad/<guard>-*``
must be rejected by the guard their name starts with.
"""

from __future__ import annotations

import dataclasses
import tomllib
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
        devices: devices the fixture can be judged on (``None``: any); from ``fixtures/requires.toml``
            (``[name] devices = ["cuda"]``), kept outside the overlay so it is never part of a candidate.
    """

    name: str
    path: Path
    good: bool
    expected_guard: str | None
    devices: tuple[str, ...] | None = None

    def runs_on(self, device: str) -> bool:
        """Whether the fixture can be judged on ``device``."""
        return self.devices is None or device in self.devices


def read_requires(folder: Path) -> dict[str, tuple[str, ...]]:
    """Devices per fixture name from ``folder/requires.toml`` (``[name] devices = [...]``); ``{}`` without one.

    The same file format serves ``tasks/<task>/fixtures/`` and the exploit corpus's ``tests/exploits/honest/``.
    """
    path = Path(folder) / "requires.toml"
    data = tomllib.loads(path.read_text()) if path.is_file() else {}
    return {name: tuple(v["devices"]) for name, v in data.items() if isinstance(v, dict) and "devices" in v}


def list_fixtures(task: TaskSpec) -> list[Fixture]:
    """Every fixture of the task, good first, sorted by name.

    Raises:
        ValueError: a bad fixture's name does not start with a known guard name.
    """
    out = []
    requires = read_requires(Path(task.root) / "fixtures")
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
            out.append(Fixture(name, p, kind == "good", guard, requires.get(name)))
    return out


def fixture_outcome_ok(fx: Fixture, accepted: bool, rejecting_guard: str | None) -> bool:
    """Whether a judged fixture came out as its folder and name say."""
    return accepted if fx.good else (not accepted and rejecting_guard == fx.expected_guard)
