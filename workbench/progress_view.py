"""The command line's view of a judgment's progress (``guards.progress``), on stderr.

On a terminal: one live line (rich) with the guard, its phase, work done / planned, elapsed time and an
estimate of the time left; each finished guard leaves a line above it. Piped (CI logs, ``2>file``): a
plain line per phase, and for long counted phases at most one line per :data:`PIPED_EVERY_S`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.text import Text

from guards import progress
from guards.progress import Step

PIPED_EVERY_S = 15.0
"""Seconds between two piped lines of one counted phase."""
STATUS_STYLE = {"PASS": "green", "FAIL": "red", "ERROR": "magenta", "SKIP": "dim"}


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}:{s:02d}"


def describe(step: Step, now: float) -> str:
    """One plain line for ``step``: ``[2/6 correctness] 12/27 configurations ... 0:41 elapsed, ~0:20 left``."""
    where = f"[{step.index}/{step.count} {step.guard}]" if step.guard else "[judge]"
    count = f" {step.done}/{step.total}" if step.total is not None else ""
    eta = step.eta_s(now)
    left = f", ~{_clock(eta)} left" if eta is not None else ""
    return f"{where} {step.phase}{count} · {_clock(now - step.guard_started)} elapsed{left}"


class ProgressView:
    """A :class:`guards.progress.View` for the command line."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = console.is_terminal
        self._live: Live | None = None
        self._last_phase: tuple[str, str] | None = None
        self._last_print = 0.0
        self._unprinted: Step | None = None  # the newest step of a counted phase, when its count was not printed

    def start(self) -> None:
        if self.live:
            self._live = Live(Text(""), console=self.console, refresh_per_second=4, transient=True)
            self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def update(self, step: Step) -> None:
        now = time.monotonic()
        line = describe(step, now)
        if self._live is not None:
            self._live.update(Text(line))
            return
        key = (step.guard, step.phase)
        if key != self._last_phase:
            self._flush(now)  # a counted phase that ended between two piped lines: its final count
        if step.phase == "starting":  # the guard's finished line says all a log needs
            return
        if key != self._last_phase or (step.total is not None and now - self._last_print >= PIPED_EVERY_S):
            self._last_phase, self._last_print = key, now
            self._unprinted = None
            self.console.print(line, markup=False, highlight=False)
        elif step.total is not None:
            self._unprinted = step

    def _flush(self, now: float) -> None:
        """Print the count a counted phase ended at when no piped line showed it (a phase shorter than
        :data:`PIPED_EVERY_S` otherwise leaves only its ``0/N`` line in a log)."""
        if self._unprinted is not None:
            self.console.print(describe(self._unprinted, now), markup=False, highlight=False)
            self._unprinted = None

    def guard_finished(self, guard: str, status: str, seconds: float, summary: str) -> None:
        if self._live is None:
            self._flush(time.monotonic())
        style = STATUS_STYLE.get(status, "")
        name = escape(guard.ljust(12))
        self.console.print(f"  {name} [{style}]{status:<5}[/] {seconds:6.1f} s  {escape(summary[:120])}")


@contextlib.contextmanager
def showing_progress(console: Console) -> Iterator[ProgressView]:
    """Show the progress of judgments run inside the block on ``console`` (stderr)."""
    view = ProgressView(console)
    view.start()
    old = progress.set_view(view)
    try:
        yield view
    finally:
        progress.set_view(old)
        view.stop()
