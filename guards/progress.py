"""Progress of a judgment: which guard runs, what it is doing, how far it got.

Guards and the judge report steps here; the command line shows them (``workbench.progress_view``).
Without a view (tests, the library API) every call is a no-op apart from the debug log. One judgment
runs per process at a time: the state is module-level, guarded by a lock so helper threads (one per
TP rank) may report too.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Protocol

logger = logging.getLogger("workbench.progress")


@dataclasses.dataclass(frozen=True)
class Step:
    """What the judgment is doing now.

    Attributes:
        guard: the running guard's name ('' before the first).
        index, count: the guard's 1-based position and the number of guards.
        phase: one line: what the guard does now (e.g. ``timing k3_t8 (2/7)``).
        done, total: units of work finished and planned in this phase (calls, configurations), or None.
        guard_started, phase_started: ``time.monotonic()`` seconds when the guard and the phase began.
    """

    guard: str = ""
    index: int = 0
    count: int = 0
    phase: str = ""
    done: int | None = None
    total: int | None = None
    guard_started: float = 0.0
    phase_started: float = 0.0

    def eta_s(self, now: float) -> float | None:
        """Seconds left in this phase at the rate so far (None until a unit of work is done)."""
        if not self.done or self.total is None or self.done >= self.total:
            return None
        return (now - self.phase_started) / self.done * (self.total - self.done)


class View(Protocol):
    """Where progress goes (the command line's live line, or a log)."""

    def update(self, step: Step) -> None: ...

    def guard_finished(self, guard: str, status: str, seconds: float, summary: str) -> None: ...


_lock = threading.Lock()
_view: View | None = None
_step = Step()


def set_view(view: View | None) -> View | None:
    """Install ``view`` (None: none); returns the previous one."""
    global _view
    with _lock:
        old, _view = _view, view
    return old


def current() -> Step:
    """The step last reported."""
    return _step


_interrupt = threading.Event()
"""Set by the CLI's SIGINT handler: Ctrl-C was pressed during this judgment."""


def request_interrupt() -> None:
    """Record a Ctrl-C (called from the SIGINT handler, before it raises ``KeyboardInterrupt``)."""
    _interrupt.set()


def clear_interrupt() -> None:
    """Forget a recorded Ctrl-C (a new judgment starts, or the interrupted one was handled)."""
    _interrupt.clear()


def check_interrupt() -> None:
    """Raise ``KeyboardInterrupt`` when a Ctrl-C was recorded.

    Python drops an exception raised while a finalizer (``__del__``, a weakref callback) runs in the
    main thread ("Exception ignored in ..."), so a ``KeyboardInterrupt`` that lands there is lost and the
    judgment would go on; every progress report and every finished child checks again, so the Ctrl-C
    takes effect at the next one. Source: the CI run of session 6 (a SIGINT mid-correctness was lost,
    the run went on to perf).

    Raises:
        KeyboardInterrupt: a Ctrl-C was recorded (:func:`request_interrupt`).
    """
    if _interrupt.is_set():
        raise KeyboardInterrupt


def _publish(step: Step) -> None:
    global _step
    check_interrupt()
    with _lock:
        _step = step
        view = _view
    if view is not None:
        view.update(step)


def guard_started(name: str, index: int, count: int) -> None:
    """The pipeline starts guard ``name`` (``index`` of ``count``, 1-based)."""
    now = time.monotonic()
    logger.debug("guard %s (%d/%d) started", name, index, count)
    _publish(Step(guard=name, index=index, count=count, phase="starting", guard_started=now, phase_started=now))


def phase(text: str, *, done: int | None = None, total: int | None = None) -> None:
    """The running guard begins a new phase (``done``/``total`` units of work, when countable)."""
    now = time.monotonic()
    logger.debug("%s: %s", _step.guard or "judge", text)
    _publish(dataclasses.replace(_step, phase=text, done=done, total=total, phase_started=now))


def advance(done: int) -> None:
    """``done`` units of the current phase are finished (cheap: call it per unit; the view throttles)."""
    s = _step
    if s.total is not None and done != s.done:
        _publish(dataclasses.replace(s, done=done))


def guard_finished(name: str, status: str, seconds: float, summary: str) -> None:
    """Guard ``name`` ended with ``status`` (PASS/FAIL/ERROR/SKIP) after ``seconds``."""
    with _lock:
        view = _view
    if view is not None:
        view.guard_finished(name, status, seconds, summary)
