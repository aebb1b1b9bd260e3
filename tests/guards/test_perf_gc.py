"""The perf child keeps Python's cyclic garbage collector off while serving and ends every call with a
collection inside the call's own timed window (``guards/_child_main.py`` ``_serve``)."""

from __future__ import annotations

import statistics

import pytest

import guards.perf as perf
from guards.correctness import CorrectnessGuard
from guards.verdict import Status
from tests.guards.test_guard_units import GOOD, _candidate

FAILS_ON_TIMINGS = perf._fails_on_timings  # the real one (``_one_workload`` patches it away)

CYCLIC_COST = '''

import time as _time

_fast_route_dispatch = moe_route_dispatch


class _Scratch:
    """A per-call scratch object in a reference cycle: only the cyclic collector frees it, and its
    finalizer spends 3 ms of CPU (a cost hidden wherever the collection lands)."""

    def __init__(self):
        self.me = self

    def __del__(self):
        t = _time.thread_time()
        while _time.thread_time() - t < 0.003:
            pass


def moe_route_dispatch(router_logits, *args, **kwargs):
    _Scratch()
    return _fast_route_dispatch(router_logits, *args, **kwargs)
'''

GC_ENABLED = '''

import gc as _gc

_fast_route_dispatch = moe_route_dispatch


def moe_route_dispatch(router_logits, *args, **kwargs):
    _gc.enable()
    return _fast_route_dispatch(router_logits, *args, **kwargs)
'''


def _one_workload(ctx, monkeypatch):
    assert CorrectnessGuard().check(ctx).status is Status.PASS  # records the declared scope
    ctx.task = ctx.task.model_copy(update={"perf": ctx.task.perf.model_copy(update={
        "workloads": ctx.task.perf.workloads[:1], "warmup": 2, "repetitions": 12})})
    monkeypatch.setattr(perf, "PERF_RANDOM_DRAWS", 0)
    monkeypatch.setattr(perf, "PERF_DOMAIN_DRAWS", 0)
    monkeypatch.setattr(perf, "_fails_on_timings", lambda *a: False)  # every call timed


@pytest.mark.slow
def test_cyclic_garbage_is_collected_and_charged_inside_the_call_that_made_it(pristine_repo, tmp_path, monkeypatch):
    """Session 13's red team (a4b): a cost hidden in the finalizer of cyclic garbage landed wherever the
    collector happened to run (in some call, between calls, or past the workload). Now each call pays for
    its own garbage in its own window, and nothing is left for between the calls."""
    ctx = _candidate(pristine_repo, tmp_path, (pristine_repo / GOOD).read_text() + CYCLIC_COST, "cyclic")
    _one_workload(ctx, monkeypatch)
    v = perf.PerfGuard().check(ctx)
    assert v.status is Status.FAIL, v.summary
    row = ctx.artifacts.perf[0]
    assert min(row["candidate_us"]) >= 3000.0, row["candidate_us"]  # every call charged its own 3 ms
    # The baseline makes no garbage: its typical call is far below 3 ms. Its median, not its maximum: one call
    # of a shared CI machine took 3,011 us where the others took 650-1,000 (landing CI of session 21).
    assert statistics.median(row["baseline_us"]) < 3000.0, row["baseline_us"]
    assert row["verdict"] in ("regression", "mean_regression"), row["verdict"]
    assert row["candidate_outside_cpu_us"] is not None and row["candidate_outside_cpu_us"] < perf.OUTSIDE_CPU_ABS_US


@pytest.mark.slow
def test_a_candidate_that_turns_the_collector_back_on_fails(pristine_repo, tmp_path, monkeypatch):
    """The runtime backstop (the audit refuses ``gc`` statically): collections would land between calls again."""
    ctx = _candidate(pristine_repo, tmp_path, (pristine_repo / GOOD).read_text() + GC_ENABLED, "gc-on")
    _one_workload(ctx, monkeypatch)
    v = perf.PerfGuard().check(ctx)
    assert v.status is Status.FAIL, v.summary
    assert "GarbageCollector: candidate code re-enabled" in v.summary, v.summary


# ---- a burst of CPU between calls: the window is timed once more, judged on the second alone if clean ----

SLOW_AFTER_FIRST_WINDOW = '''

import time as _time

_fast_route_dispatch = moe_route_dispatch
_calls = [0]


def moe_route_dispatch(router_logits, *args, **kwargs):
    _calls[0] += 1
    if _calls[0] > 14:  # honest-looking for the warm-up and the first window (2 + 12 calls), then slow
        t = _time.thread_time()
        while _time.thread_time() - t < 0.003:
            pass
    return _fast_route_dispatch(router_logits, *args, **kwargs)
'''


def _bursts(monkeypatch, per_window_us: list[float]):
    """The candidate child's CPU clock, as the judge reads it, gains ``per_window_us[i]`` after the i-th
    timing window of the workload (a stand-in for a driver thread's burst, or for deferred work)."""
    import guards.judge

    real = guards.judge.time_workload
    windows = [0]

    def timed(servers, *args, **kwargs):
        out = real(servers, *args, **kwargs)
        i = windows[0]
        windows[0] += 1
        if i < len(per_window_us) and per_window_us[i]:
            sess = servers["candidate"].session
            read, extra = sess.cpu_ns, int(per_window_us[i] * 1e3)
            sess.cpu_ns = lambda: read() + extra
        return out

    monkeypatch.setattr(guards.judge, "time_workload", timed)
    monkeypatch.setattr(perf, "PERF_EXTENSION_ROUNDS", 0)  # windows: the workload's, then its re-measure
    monkeypatch.setattr(perf, "LATE_RECHECKS", 0)
    return windows


@pytest.mark.slow
def test_one_burst_between_calls_is_timed_again_and_judged_on_the_clean_window(pristine_repo, tmp_path, monkeypatch):
    """The H200 runs of sessions 14 and 16 failed an honest kernel once each on ~7.2 ms of CPU outside the
    calls of one window (not repeated): the window is re-measured, and the clean second window decides."""
    ctx = _candidate(pristine_repo, tmp_path, (pristine_repo / GOOD).read_text(), "burst-once")
    _one_workload(ctx, monkeypatch)
    windows = _bursts(monkeypatch, [8000.0])
    perf.PerfGuard().check(ctx)
    row = ctx.artifacts.perf[0]
    assert windows[0] == 2  # the workload, then its re-measure
    assert row["outside_cpu_first_window_us"] >= 8000.0
    assert row["verdict"] != "busy_outside" and row["candidate_outside_cpu_us"] < perf.OUTSIDE_CPU_ABS_US
    assert len(row["candidate_us"]) == 12  # the second window alone
    assert "judged on the second window alone, clean" in row["implementation"]
    from workbench.results import PerfResult

    assert PerfResult(**row).outside_cpu_first_window_us == row["outside_cpu_first_window_us"]  # the result file's schema


@pytest.mark.slow
def test_bursts_in_both_windows_fail_as_busy_outside(pristine_repo, tmp_path, monkeypatch):
    ctx = _candidate(pristine_repo, tmp_path, (pristine_repo / GOOD).read_text(), "burst-twice")
    _one_workload(ctx, monkeypatch)
    _bursts(monkeypatch, [8000.0, 8000.0])
    v = perf.PerfGuard().check(ctx)
    assert v.status is Status.FAIL
    row = ctx.artifacts.perf[0]
    assert row["verdict"] == "busy_outside", row["verdict"]
    assert row["candidate_outside_cpu_us"] >= 16000.0  # both windows, against all their calls
    assert "busy between its calls" in v.summary


@pytest.mark.slow
def test_a_candidate_that_is_fast_only_in_the_first_window_gains_nothing_from_the_re_measure(
        pristine_repo, tmp_path, monkeypatch):
    """Deferring work out of the first window (here: fast for its first 14 calls, then 3 ms a call) and
    triggering the re-measure: the second window alone is judged, so the slow calls decide."""
    ctx = _candidate(pristine_repo, tmp_path, (pristine_repo / GOOD).read_text() + SLOW_AFTER_FIRST_WINDOW, "fast-first")
    _one_workload(ctx, monkeypatch)
    _bursts(monkeypatch, [8000.0])
    v = perf.PerfGuard().check(ctx)
    assert v.status is Status.FAIL, v.summary
    row = ctx.artifacts.perf[0]
    assert min(row["candidate_us"]) >= 3000.0, row["candidate_us"]
    assert row["verdict"] in ("regression", "mean_regression"), row["verdict"]


SLOW_IN_FIRST_WINDOW = '''

import time as _time

_fast_route_dispatch = moe_route_dispatch
_calls = [0]


def moe_route_dispatch(router_logits, *args, **kwargs):
    _calls[0] += 1
    if _calls[0] <= 14:  # slow for the warm-up and the first window (2 + 12 calls), then fast
        t = _time.thread_time()
        while _time.thread_time() - t < 0.003:
            pass
    return _fast_route_dispatch(router_logits, *args, **kwargs)
'''


@pytest.mark.slow
def test_a_first_window_that_fails_on_its_timings_is_never_re_measured(pristine_repo, tmp_path, monkeypatch):
    """Session 16's code review: a kernel slow for its first window, with a burst to trigger the re-measure,
    then fast and clean, was accepted on the second window. A window failing on its own timings now fails."""
    ctx = _candidate(pristine_repo, tmp_path, (pristine_repo / GOOD).read_text() + SLOW_IN_FIRST_WINDOW, "slow-first")
    _one_workload(ctx, monkeypatch)
    monkeypatch.setattr(perf, "_fails_on_timings", FAILS_ON_TIMINGS)
    windows = _bursts(monkeypatch, [8000.0])
    v = perf.PerfGuard().check(ctx)
    assert v.status is Status.FAIL, v.summary
    assert windows[0] == 1  # no second window
    row = ctx.artifacts.perf[0]
    assert row["outside_cpu_first_window_us"] is None and min(row["candidate_us"]) >= 3000.0
    # busy_outside, not a timing verdict, even though it is slow too: its pairs are never pooled across
    # judgings (workbench.retries), and the summary still gives the speedup
    assert row["verdict"] == "busy_outside" and row["candidate_outside_cpu_us"] >= 8000.0
    assert "busy between its calls" in v.summary and "x (CI " in v.summary, v.summary


@pytest.mark.slow
def test_more_than_twice_the_allowance_between_calls_fails_without_a_re_measure(pristine_repo, tmp_path, monkeypatch):
    ctx = _candidate(pristine_repo, tmp_path, (pristine_repo / GOOD).read_text(), "burst-large")
    _one_workload(ctx, monkeypatch)
    windows = _bursts(monkeypatch, [50000.0])
    v = perf.PerfGuard().check(ctx)
    assert v.status is Status.FAIL and windows[0] == 1
    assert ctx.artifacts.perf[0]["verdict"] == "busy_outside"
