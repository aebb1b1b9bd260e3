"""Helpers for the pool tests (a uniquely named module: ``conftest`` is not importable safely).

:class:`SlowGuard` holds a verdict in its worker long enough to kill that worker; the tests send it to the
Ray workers by value (``ray.cloudpickle.register_pickle_by_value``), since the workers cannot import this
folder.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from guards.verdict import Status, Verdict

TRUTHY = ("1", "true", "yes")


def in_ci() -> bool:
    """Under ``CI=true`` a missing service is a failure, not a skip (issue 16 item 4)."""
    return os.environ.get("CI", "").lower() in TRUTHY


class SlowGuard:
    """A guard that sleeps ``sleep_s`` seconds unless ``marker`` exists, then PASSes.

    It creates ``marker`` (a path on the machine the tests and the Ray workers share) before it sleeps, so
    the first try of a verdict sleeps (and is killed) and a retry passes at once.
    """

    name = "slow"
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()

    def __init__(self, marker: str, sleep_s: float = 120.0) -> None:
        self.marker, self.sleep_s = marker, sleep_s

    def check(self, ctx) -> Verdict:
        m = Path(self.marker)
        if not m.exists():
            m.write_text(str(os.getpid()))
            time.sleep(self.sleep_s)
        return Verdict(guard=self.name, status=Status.PASS, summary=f"slept unless {m.name} existed")
