"""The perf guard's per-configuration statuses, with what each one means and what must hold for it.

Every timed (or untimed) configuration of a perf verdict carries one :class:`PerfStatus`. The enum
is the one place that says which statuses fail the guard, which ones machine load can cause, which
ones the timings alone decide (so their pairs may be pooled across judgings, ``workbench.retries``),
how a failing one reads in the verdict's summary, and which fields an entry of that status must
carry (:meth:`PerfStatus.problem`, run by the result file's ``PerfResult`` validator): a ``gain``
whose interval reaches 1 or a ``below_floor`` without a floor is a bug in the guard, refused when the
result is built rather than written into a verdict.

Source: issue 17 item 4 ("a PerfStatus enum with a validator per status"); the statuses and their
meaning: guards/perf.py (``classify``, ``physical_checks``, the judge's checks in ``_judge``).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any


class PerfStatus(StrEnum):
    """What the perf guard decided for one configuration (a ``str``: result files hold the value).

    Members (value: meaning):
        GAIN ``gain``: claimed, median speedup >= the task's ``min_speedup`` and interval above 1.
        NEUTRAL ``neutral``: judged for regressions only (a random draw, or a merged base kernel's configuration
            the candidate does not claim), none found; a speedup there is reported, never required.
        REGRESSION ``regression``: slower than the baseline beyond ``max_regression_pct``, significant.
        NO_GAIN ``no_gain``: claimed, but the gain is not shown (median or interval).
        NOT_CLAIMED ``not_claimed``: outside the kernel's scope; both sides run the standard path, untimed.
        BELOW_FLOOR ``below_floor``: faster than the physical floor (CUDA): the timing was subverted.
        SIDE_STREAM ``side_stream``: work left running outside the timed window (CUDA).
        TAMPERED ``tampered``: the timer's samples disagree with the judge's own clocks.
        WRONG_OUTPUT ``wrong_output``: a timed call's outputs differ from the reference.
        BUSY_OUTSIDE ``busy_outside``: CPU time spent between calls (background or deferred work).
        WAITS ``waits``: CPU only; off-CPU waits inside the calls beyond the baseline's.
        RAISED ``raised``: a timed call raised or failed a runtime check.
        COMPILED_TIMED ``compiled_timed``: CUDA; the candidate compiled a CuTe DSL kernel inside a timed
            call (compile once per compile-time key during warm-up: ``kernels.cutedsl.CompileCache``).
        MEAN_REGRESSION ``mean_regression``: slower on average (wall clock, every call counted at its
            size): slow on a minority of calls, or waiting off-CPU on some, where the median is unmoved.
    """

    GAIN = "gain"
    NEUTRAL = "neutral"
    REGRESSION = "regression"
    NO_GAIN = "no_gain"
    NOT_CLAIMED = "not_claimed"
    BELOW_FLOOR = "below_floor"
    SIDE_STREAM = "side_stream"
    TAMPERED = "tampered"
    WRONG_OUTPUT = "wrong_output"
    BUSY_OUTSIDE = "busy_outside"
    WAITS = "waits"
    RAISED = "raised"
    COMPILED_TIMED = "compiled_timed"
    MEAN_REGRESSION = "mean_regression"

    @property
    def failing(self) -> bool:
        """Whether a configuration with this status fails the perf guard."""
        return self not in (PerfStatus.GAIN, PerfStatus.NEUTRAL, PerfStatus.NOT_CLAIMED)

    @property
    def load_sensitive(self) -> bool:
        """Whether load from other processes on a shared machine can cause this status (it is re-measured
        before it fails, ``guards.perf.PERF_EXTENSION_ROUNDS``, and flagged when the machine was loaded)."""
        return self in (PerfStatus.REGRESSION, PerfStatus.NO_GAIN, PerfStatus.WAITS, PerfStatus.MEAN_REGRESSION)

    @property
    def timing_only(self) -> bool:
        """Whether the paired timings alone decide this status (no output, clock or physics check did),
        so the pairs of several judgings of the same content may be pooled and re-classified."""
        return self in (PerfStatus.GAIN, PerfStatus.NO_GAIN, PerfStatus.NEUTRAL, PerfStatus.REGRESSION)

    @property
    def claimed(self) -> bool:
        """Whether the status belongs to a configuration the kernel claims (a gain was required)."""
        return self in (PerfStatus.GAIN, PerfStatus.NO_GAIN)

    def describe(self, r: Mapping[str, Any], *, min_speedup: float) -> str:
        """How a configuration entry of this status reads after "is" in the verdict's summary.

        Args:
            r: the configuration's entry (``PerfResult`` fields).
            min_speedup: the task's required speedup (ratio), named by ``no_gain``.
        """
        impl = r.get("implementation", "")
        late = (f" when timed again late (after {r.get('late_recheck_gap')} more untimed calls)"
                if "late recheck" in impl else "")
        return {
            PerfStatus.REGRESSION: f"slower than the baseline ({r.get('baseline_implementation', 'standard')}){late}",
            PerfStatus.BELOW_FLOOR: f"faster than physically possible (floor {r.get('floor_us') or 0:.1f} us)",
            PerfStatus.SIDE_STREAM: f"leaving work outside its timed window ({r.get('tail_excess_us') or 0:.1f} us "
                                    "longer tail than the baseline)",
            PerfStatus.TAMPERED: f"timed untrustworthily [{impl}]",
            PerfStatus.WRONG_OUTPUT: f"wrong while timed [{impl}]",
            PerfStatus.BUSY_OUTSIDE: f"busy between its calls ({r.get('candidate_outside_cpu_us') or 0:.0f} us of CPU "
                                     "outside them: background or deferred work)",
            PerfStatus.WAITS: f"waiting off-CPU inside its calls ({r.get('wait_excess_us') or 0:.0f} us more than "
                              "the baseline per call)",
            PerfStatus.RAISED: f"failing while timed [{impl}]",
            PerfStatus.COMPILED_TIMED: f"compiled inside a timed call [{impl}]",
            PerfStatus.NO_GAIN: f"no real gain (need >= {min_speedup}x with the interval above 1)",
            PerfStatus.MEAN_REGRESSION: f"slower on average ({r.get('mean_ratio') or 0:.2f}x the baseline's mean time per "
                                        "call, wall clock: some calls slow or waiting, the median unmoved)" + late,
        }.get(self, self.value)

    def problem(self, r: Mapping[str, Any]) -> str | None:
        """Why entry ``r`` cannot carry this status (a guard bug), or ``None`` when it is consistent.

        What must hold, per status:
            gain: both sides timed, speedup > 1 and the interval's lower end > 1.
            neutral, no_gain, regression: both sides timed (regression: speedup < 1, unless the entry
                says its timer was tampered with).
            not_claimed: nothing timed (both sides ran the standard path).
            below_floor: a floor (``floor_us``). side_stream: a tail excess (``tail_excess_us``).
            busy_outside: ``candidate_outside_cpu_us``. waits: ``wait_excess_us``. mean_regression:
                ``mean_ratio``.
            tampered, wrong_output, raised, compiled_timed: the implementation names the cause in parentheses.

        Args:
            r: the configuration's entry (``PerfResult`` fields: ``baseline_us``, ``candidate_us``,
                ``speedup``, ``speedup_ci``, ``implementation``, the optional physical fields).
        """
        timed = bool(r.get("baseline_us")) and bool(r.get("candidate_us"))
        impl = str(r.get("implementation", ""))
        speedup, ci = r.get("speedup"), r.get("speedup_ci") or (None, None)
        if self is PerfStatus.NOT_CLAIMED:
            return None if not r.get("baseline_us") and not r.get("candidate_us") else \
                "a not_claimed configuration is not timed, yet it has samples"
        if self in (PerfStatus.GAIN, PerfStatus.NEUTRAL, PerfStatus.NO_GAIN, PerfStatus.REGRESSION) and not timed:
            return f"a {self.value} configuration needs samples of both sides"
        if self is PerfStatus.GAIN and not (speedup is not None and speedup > 1.0 and ci[0] is not None and ci[0] > 1.0):
            return f"a gain needs speedup > 1 and an interval above 1; got {speedup} with interval {tuple(ci)}"
        if self is PerfStatus.REGRESSION and not (speedup is not None and speedup < 1.0) and "tamper" not in impl:
            return f"a regression needs speedup < 1 (or a tampered timer named); got {speedup}"
        needs = {PerfStatus.BELOW_FLOOR: "floor_us", PerfStatus.SIDE_STREAM: "tail_excess_us",
                 PerfStatus.BUSY_OUTSIDE: "candidate_outside_cpu_us", PerfStatus.WAITS: "wait_excess_us",
                 PerfStatus.MEAN_REGRESSION: "mean_ratio"}.get(self)
        if needs is not None and r.get(needs) is None:
            return f"a {self.value} configuration needs {needs}"
        if self in (PerfStatus.TAMPERED, PerfStatus.WRONG_OUTPUT, PerfStatus.RAISED,
                    PerfStatus.COMPILED_TIMED) and "(" not in impl:
            return f"a {self.value} configuration must name its cause in the implementation; got {impl!r}"
        return None
