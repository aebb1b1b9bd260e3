"""The progress line: what it says, its estimate, and the guards' reports reaching a view."""

from __future__ import annotations

from guards import progress
from guards.progress import Step
from workbench.progress_view import describe


def test_line_names_guard_phase_count_elapsed_and_estimate():
    s = Step(guard="perf", index=6, count=6, phase="timing k3_t8 (2/7 workloads), calls a side", done=40, total=170,
             guard_started=100.0, phase_started=110.0)
    # 40 calls in 20 s: 130 left take 65 s
    assert s.eta_s(130.0) == 65.0
    assert describe(s, 130.0) == "[6/6 perf] timing k3_t8 (2/7 workloads), calls a side 40/170 · 0:30 elapsed, ~1:05 left"
    assert Step(phase="x", total=10, done=0).eta_s(5.0) is None  # no rate yet
    assert describe(Step(phase="export"), 3.0) == "[judge] export · 0:03 elapsed"


class _Recorder:
    def __init__(self):
        self.steps, self.finished = [], []

    def update(self, step):
        self.steps.append(step)

    def guard_finished(self, guard, status, seconds, summary):
        self.finished.append((guard, status))


def test_reports_reach_the_view_and_advance_keeps_the_phase():
    rec = _Recorder()
    old = progress.set_view(rec)
    try:
        progress.guard_started("correctness", 3, 6)
        progress.phase("TP 2: 5 configurations", done=0, total=4)
        progress.advance(1)
        progress.advance(1)  # no change: not published again
        progress.guard_finished("correctness", "PASS", 1.5, "ok")
    finally:
        progress.set_view(old)
    assert [(s.guard, s.phase, s.done) for s in rec.steps] == [
        ("correctness", "starting", None), ("correctness", "TP 2: 5 configurations", 0),
        ("correctness", "TP 2: 5 configurations", 1)]
    assert rec.finished == [("correctness", "PASS")]
    progress.phase("after")  # no view: nothing breaks


def test_finished_line_keeps_brackets_of_guard_names_and_summaries():
    """Terminal markup is escaped: ``correctness[seed=0]`` and ``[k3_t8]`` reach the screen as written."""
    import io

    from rich.console import Console

    from workbench.progress_view import ProgressView

    buf = io.StringIO()
    view = ProgressView(Console(file=buf, force_terminal=False, width=200))
    view.guard_finished("correctness[seed=0]", "FAIL", 2.0, "wrong at [k3_t8] [bold]x[/bold]")
    out = buf.getvalue()
    assert "correctness[seed=0]" in out and "wrong at [k3_t8] [bold]x[/bold]" in out, out


def test_piped_log_shows_where_a_short_counted_phase_ended():
    """helper-25 (session 22): a piped log read "0/170" for every perf workload, because a workload timed in
    less than PIPED_EVERY_S printed only its first line. The count it ended at is printed when the next
    phase (or the guard's end) comes; a phase whose last count was printed adds nothing."""
    import io

    from rich.console import Console

    from workbench.progress_view import ProgressView

    buf = io.StringIO()
    view = ProgressView(Console(file=buf, force_terminal=False, width=300))
    old = progress.set_view(view)
    try:
        progress.guard_started("perf", 6, 6)
        progress.phase("timing k3_t8 (1/2 workloads), calls a side", done=0, total=170)
        for n in range(1, 171):
            progress.advance(n)
        progress.phase("timing k3_t64 (2/2 workloads), calls a side", done=0, total=170)
        progress.advance(60)
        progress.guard_finished("perf", "PASS", 3.0, "ok")
        progress.phase("export")  # an uncounted phase: its line only
    finally:
        progress.set_view(old)
    lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
    counts = [ln.split(", calls a side ")[1].split(" ")[0] for ln in lines if "calls a side" in ln]
    assert counts == ["0/170", "170/170", "0/170", "60/170"], lines
    assert lines[-2].lstrip().startswith("perf") and "PASS" in lines[-2] and lines[-1].startswith("[6/6 perf] export")
