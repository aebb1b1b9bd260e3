"""The perf guard's extension rounds: a claimed gain whose interval is inconclusive is timed longer."""

from __future__ import annotations

import random

import pytest

import guards.perf as perf
from guards.correctness import CorrectnessGuard
from guards.judge import SideRecord
from guards.verdict import Status
from tests.guards.test_guard_units import GOOD, _candidate
from workbench.taskspec import load_task


def _rec(base: list[float], cand: list[float]) -> dict:
    return {"baseline": SideRecord(cpu_us=list(base), wall_us=list(base), statuses=[b"k"] * len(base)),
            "candidate": SideRecord(cpu_us=list(cand), wall_us=list(cand), statuses=[b"k"] * len(cand))}


def _noisy(n: int, speedup: float, noise: float, seed: int) -> tuple[list[float], list[float]]:
    rng = random.Random(seed)
    base = [100.0 * (1 + rng.uniform(-noise, noise)) for _ in range(n)]
    return base, [b / speedup * (1 + rng.uniform(-noise, noise)) for b in base]


def test_inconclusive_gain_only_for_a_big_median_whose_interval_reaches_one(project_repo):
    task = load_task(project_repo, "k3_moe_dispatch")
    # per-pair ratios 1.3 (11 pairs) and 0.8 (9 pairs): median 1.3, the bootstrap's low end at 0.8
    noisy = _rec([100.0] * 20, [100.0 / 1.3] * 11 + [100.0 / 0.8] * 9)
    stats = perf.classify(noisy["baseline"].cpu_us, noisy["candidate"].cpu_us, claimed=True,
                          max_regression_pct=task.perf.max_regression_pct, min_speedup=task.perf.min_speedup,
                          confidence=task.perf.confidence, alpha=task.perf.alpha)
    assert stats["verdict"] == "no_gain" and stats["speedup"] >= task.perf.min_speedup, stats  # the premise
    assert perf._inconclusive_gain(task, "cpu", noisy, True, 0)
    assert not perf._inconclusive_gain(task, "cpu", noisy, False, 0)  # unclaimed: no gain is asked for
    clear = _rec(*_noisy(150, 1.11, 0.02, seed=2))
    assert not perf._inconclusive_gain(task, "cpu", clear, True, 0)  # already a gain
    same = _rec(*_noisy(150, 1.0, 0.3, seed=3))
    assert not perf._inconclusive_gain(task, "cpu", same, True, 0)  # median under min_speedup: a plain no_gain


def test_side_record_extend_appends_every_field():
    a = SideRecord(cpu_us=[1.0], wall_us=[2.0], outputs=[{"x": 1}], statuses=[b"k"])
    a.extend(SideRecord(cpu_us=[3.0], wall_us=[4.0], outputs=[{"x": 2}], statuses=[b"!"]))
    assert (a.cpu_us, a.wall_us, a.outputs, a.statuses) == ([1.0, 3.0], [2.0, 4.0], [{"x": 1}, {"x": 2}], [b"k", b"!"])


@pytest.mark.slow
def test_inconclusive_workload_gets_extension_rounds_with_fresh_checked_inputs(pristine_repo, tmp_path, monkeypatch):
    project_repo = pristine_repo  # the good fixture judged as a new kernel
    """With the interval forced inconclusive, the workload is timed 1 + PERF_EXTENSION_ROUNDS rounds; every
    extra call's outputs are checked too (a wrong extension call would be ``wrong_output``)."""
    ctx = _candidate(project_repo, tmp_path, (project_repo / GOOD).read_text(), "ext")
    assert CorrectnessGuard().check(ctx).status is Status.PASS  # records the declared scope
    task = ctx.task.model_copy(update={"perf": ctx.task.perf.model_copy(update={
        "workloads": ctx.task.perf.workloads[:1], "warmup": 2, "repetitions": 12})})
    ctx.task = task
    monkeypatch.setattr(perf, "PERF_RANDOM_DRAWS", 0)
    monkeypatch.setattr(perf, "PERF_DOMAIN_DRAWS", 0)
    monkeypatch.setattr(perf, "LATE_RECHECKS", 0)  # the rounds' calls alone (the late recheck has its own test)
    calls = []

    def always(task, device, rec, claimed, seed):
        calls.append(len(rec["candidate"].cpu_us))
        return "the gain's interval is inconclusive" if claimed else None

    monkeypatch.setattr(perf, "_needs_another_round", always)
    checked = []
    real = perf.CallCheck.result

    def spy(self, calls=None):
        checked.append((self.checked, calls))
        return real(self, calls)

    monkeypatch.setattr(perf.CallCheck, "result", spy)
    perf.PerfGuard().check(ctx)
    (entry,) = ctx.artifacts.perf
    n = 1 + perf.PERF_EXTENSION_ROUNDS
    assert entry["extension_rounds"] == perf.PERF_EXTENSION_ROUNDS
    assert len(entry["candidate_us"]) == len(entry["baseline_us"]) == 12 * n
    assert calls == [12 * r for r in range(1, n)]  # asked after each round until the rounds ran out
    assert checked == [(2 + 12 * n, 2 + 12 * n)]
    assert entry["verdict"] != "wrong_output", entry["implementation"]


def test_the_call_check_counts_the_extension_rounds(project_repo):
    task = load_task(project_repo, "k3_moe_dispatch")
    n = task.perf.warmup + task.perf.repetitions
    check = perf.CallCheck(task, None, 0)
    check.checked = n  # one round's calls checked, two rounds' made
    got = check.result(calls=task.perf.warmup + 2 * task.perf.repetitions)
    assert got == f"the judge checked the outputs of {n} calls for {task.perf.warmup + 2 * task.perf.repetitions} calls"
    assert check.result() is None  # one round made, one round checked
    late = perf.CallCheck(task, None, 0, first=n)
    late.checked = 10
    assert late.result(calls=n + 10) is None and late.result(calls=n + 11) is not None


def test_the_call_check_runs_no_reference_between_pairs_and_fails_the_first_wrong_call_after(project_repo, monkeypatch):
    """Outputs equal to the baseline's are let go as they are read; the others are checked against the reference
    after the window, on their inputs drawn again: the judge's work between two pairs never depends on which
    calls the candidate makes miss the baseline's bits (session 25's review)."""
    import torch

    from guards.cases import build_case, perf_inputs

    task = load_task(project_repo, "k3_small_m_gemm")
    case = build_case(task, next(w for w in task.correctness.workloads if w.name == task.perf.workloads[0]), 3)
    seed = 17
    check = perf.CallCheck(task, case, seed)
    real = check.ref.reference
    ins = [perf_inputs(task, case.workload, seed, j) for j in range(4)]
    want = [real({k: v.clone() for k, v in x.items()}, dict(case.kwargs)) for x in ins]
    calls = []
    monkeypatch.setattr(check.ref, "reference", lambda *a: calls.append(1) or real(*a))
    check(0, want[0], {k: v.clone() for k, v in want[0].items()})  # the baseline's bits: let go
    check(1, {k: v + 1e-7 * v.abs().max() for k, v in want[1].items()}, None)  # no baseline: kept
    check(2, {k: torch.zeros_like(v) for k, v in want[2].items()}, want[2])  # wrong: kept
    check(3, want[3], want[3])
    assert calls == [] and [j for j, _ in check.pending] == [1, 2] and check.problem is None
    assert check.result(calls=4).startswith("outputs of warm-up call 2 differ from the reference: ")
    assert calls == [1, 1] and check.pending == []  # call 1 passed its full check, call 2 failed it
    skipped = perf.CallCheck(task, case, seed)
    skipped(1, want[1], want[1])  # call 0 never reached the check
    assert skipped.result(calls=1) == "the judge read call 1 where call 0 was due"


def test_regressions_and_waits_are_re_measured_before_they_fail(project_repo):
    task = load_task(project_repo, "k3_moe_dispatch")
    slow = _rec([100.0] * 150, [130.0] * 150)
    assert perf._needs_another_round(task, "cpu", slow, False, 0) == "slower than the baseline (0.769x)"
    fine = _rec([100.0] * 150, [90.0] * 150)
    assert perf._needs_another_round(task, "cpu", fine, True, 0) is None
    waiting = _rec([100.0] * 150, [90.0] * 150)
    waiting["candidate"].wall_us = [90.0 + 500.0] * 150  # 500 us a call off-CPU, the baseline none
    assert perf._needs_another_round(task, "cpu", waiting, True, 0) == "off-CPU waits (500 us a call over the baseline's)"
    # on CUDA the judge's wall clock is the timer: the same waits are a slowdown there
    assert perf._needs_another_round(task, "cuda", waiting, True, 0) == "slower than the baseline (0.169x)"


def test_a_failure_on_a_loaded_machine_says_the_cause_may_be_the_environment(project_repo):
    task = load_task(project_repo, "k3_moe_dispatch")
    row = {"name": "k3_t64", "speedup": 1.02, "speedup_ci": (0.97, 1.08), "baseline_median_us": 100.0,
           "candidate_median_us": 98.0, "verdict": "no_gain", "load_avg": 3.4, "cpus": 2, "implementation": "x"}
    v = perf.perf_verdict(task, [row], ["k3_t64"])
    assert v.status is Status.FAIL
    assert "The machine was loaded while it was timed (load 3.4 on 2 CPUs, after re-measuring)" in v.summary
    from workbench.agents.brief import failure_cause

    assert failure_cause(v)[0] == "environment" and "machine_load = 3.4" in failure_cause(v)[1]
    quiet = perf.perf_verdict(task, [{**row, "load_avg": 0.8}], ["k3_t64"])
    assert failure_cause(quiet)[0] == "candidate"
    assert "loaded" not in quiet.summary
    wrong = perf.perf_verdict(task, [{**row, "verdict": "wrong_output"}], ["k3_t64"])
    assert "loaded" not in wrong.summary  # load does not make outputs wrong


def test_screening_takes_half_the_repetitions_rounded_up():
    assert [perf.screening_repetitions(r) for r in (1, 2, 12, 40, 41, 150)] == [1, 1, 6, 20, 21, 75]


def test_a_screening_clears_a_fast_or_equal_kernel_and_never_a_slow_one(project_repo):
    task = load_task(project_repo, "k3_moe_dispatch")
    n = perf.screening_repetitions(task.perf.repetitions)
    assert perf._cleared_early(task, "cpu", _rec(*_noisy(n, 1.3, 0.02, seed=1)), 0)
    assert perf._cleared_early(task, "cpu", _rec(*_noisy(n, 1.0, 0.01, seed=2)), 0)
    assert not perf._cleared_early(task, "cpu", _rec(*_noisy(n, 0.9, 0.01, seed=3)), 0)  # a 10% slowdown
    assert not perf._cleared_early(task, "cpu", _rec(*_noisy(n, 1.0, 0.3, seed=4)), 0)  # too noisy to tell
    waiting = _rec(*_noisy(n, 1.3, 0.02, seed=5))
    waiting["candidate"].wall_us = [u + 500.0 for u in waiting["candidate"].cpu_us]  # sleeps off-CPU
    assert not perf._cleared_early(task, "cpu", waiting, 0)
    # on CUDA the wall clock is the timer and no wait rule applies
    assert perf._cleared_early(task, "cuda", _rec(*_noisy(n, 1.3, 0.02, seed=1)), 0)


@pytest.mark.slow
def test_a_screening_rarely_clears_a_regression_at_the_threshold(project_repo):
    """The error bound in ``_cleared_early``'s docstring, measured: a kernel 6% slower than the baseline
    (past the tasks' 5% threshold) with CPU-like per-call noise is cleared on its screening pairs in at
    most 1% of 400 seeded trials (bound: 0.5%), while an equal kernel is cleared in most (the saving)."""
    task = load_task(project_repo, "k3_moe_dispatch")
    n = perf.screening_repetitions(task.perf.repetitions)
    slow = sum(perf._cleared_early(task, "cpu", _rec(*_noisy(n, 1 / 1.06, 0.05, seed=s)), s) for s in range(400))
    same = sum(perf._cleared_early(task, "cpu", _rec(*_noisy(n, 1.0, 0.05, seed=s)), s) for s in range(400))
    assert slow <= 4, slow
    assert same >= 200, same


def _screen_ctx(project_repo, tmp_path, monkeypatch, name):
    ctx = _candidate(project_repo, tmp_path, (project_repo / GOOD).read_text(), name)
    assert CorrectnessGuard().check(ctx).status is Status.PASS  # records the declared scope
    ctx.task = ctx.task.model_copy(update={"perf": ctx.task.perf.model_copy(update={
        "workloads": ctx.task.perf.workloads[:1], "warmup": 2, "repetitions": 12})})
    monkeypatch.setattr(perf, "PERF_RANDOM_DRAWS", 1)
    monkeypatch.setattr(perf, "PERF_DOMAIN_DRAWS", 0)
    monkeypatch.setattr(perf, "LATE_RECHECKS", 0)  # the screening's calls alone (the late recheck has its own test)
    monkeypatch.setattr(perf, "_fails_on_timings", lambda *a: False)  # time both whatever the load does
    checked = []
    real = perf.CallCheck.result

    def spy(self, calls=None):
        checked.append((self.case.name, self.checked, calls))
        return real(self, calls)

    monkeypatch.setattr(perf.CallCheck, "result", spy)
    return ctx, checked


@pytest.mark.slow
def test_a_cleared_draw_stops_after_its_screening_and_every_call_is_still_checked(pristine_repo, tmp_path, monkeypatch):
    ctx, checked = _screen_ctx(pristine_repo, tmp_path, monkeypatch, "screen")
    monkeypatch.setattr(perf, "_cleared_early", lambda task, device, rec, seed: True)
    perf.PerfGuard().check(ctx)
    listed, draw = ctx.artifacts.perf
    assert draw["name"].startswith("random-perf-0-") and draw["screened"]
    assert len(draw["candidate_us"]) == len(draw["baseline_us"]) == 6  # half of 12
    assert not listed["screened"] and len(listed["candidate_us"]) % 12 == 0  # a claimed gain: in full
    (n_listed, c_listed), (n_draw, c_draw) = [(n, c) for _, n, c in checked]
    assert n_listed == c_listed and (n_listed - 2) % 12 == 0  # (an extension round may follow a noisy gain)
    assert n_draw == c_draw == 2 + 6


@pytest.mark.slow
def test_a_draw_not_cleared_is_timed_in_full(pristine_repo, tmp_path, monkeypatch):
    ctx, checked = _screen_ctx(pristine_repo, tmp_path, monkeypatch, "noscreen")
    asked = []

    def never(task, device, rec, seed):
        asked.append(len(rec["candidate"].cpu_us))
        return False

    monkeypatch.setattr(perf, "_cleared_early", never)
    perf.PerfGuard().check(ctx)
    listed, draw = ctx.artifacts.perf
    assert asked == [6] and not draw["screened"] and len(draw["candidate_us"]) == 12
    assert checked[1][1:] == (14, 14) and checked[0][1] == checked[0][2]


def _outliers(n: int, speedup: float, seed: int, p: float = 0.01, size: float = 20.0):
    """Equal-cost interleaved calls with CPU-like noise and rare preemptions (probability ``p`` a call, ``size``
    times its cost) on either side, as load from other processes makes them."""
    rng = random.Random(seed)
    base, cand = _noisy(n, speedup, 0.05, seed)
    hit = lambda x: x * size if rng.random() < p else x  # noqa: E731
    return [hit(b) for b in base], [hit(c) for c in cand]


def test_a_minority_of_slow_calls_fails_on_the_mean_where_the_median_shows_a_gain(project_repo):
    """Session 12's red team: fast on 5 calls in 6, a heavy extra pass on the 6th (3.2x slower on average):
    the median of paired ratios reads a gain; the mean fails it, and neither screening nor an early stop
    lets it through."""
    task = load_task(project_repo, "k3_moe_dispatch")
    base, cand = _noisy(150, 1.25, 0.02, seed=7)
    cand = [c * 12.0 if i % 6 == 5 else c for i, c in enumerate(cand)]
    rec = _rec(base, cand)
    assert perf._classify_rec(task, "cpu", rec, True, 0)["verdict"] == "gain"  # the premise: the median is fooled
    ratio, (lo, hi), fails = perf._mean_regression(task, "cpu", rec, 0)
    assert fails and 2.0 < ratio < 2.6 and lo > 1.1, (ratio, lo, hi)
    assert perf._fails_on_timings(task, "cpu", rec, True, 0)
    assert perf._needs_another_round(task, "cpu", rec, True, 0).startswith("slower on average (2.")
    n = perf.screening_repetitions(task.perf.repetitions)
    assert not perf._cleared_early(task, "cpu", _rec(base[:n], cand[:n]), 0)


def test_waits_on_a_minority_of_calls_fail_on_the_mean_where_the_wait_quantile_is_blind(project_repo):
    """Session 12's red team: a 3 ms off-CPU wait on every 3rd call; the CPU clock shows a gain and the
    10% quantile of (wall - CPU) is unmoved, the mean of wall time is 4x."""
    task = load_task(project_repo, "k3_moe_dispatch")
    base, cand = _noisy(150, 1.2, 0.02, seed=8)
    rec = _rec(base, cand)
    rec["candidate"].wall_us = [c + (3000.0 if i % 3 == 2 else 0.0) for i, c in enumerate(cand)]
    excess, bound = perf._wait_excess(rec["baseline"], rec["candidate"])
    assert excess <= bound  # the premise: the wait rule does not see it
    ratio, _, fails = perf._mean_regression(task, "cpu", rec, 0)
    assert fails and ratio > 10, ratio


def test_the_mean_rule_rarely_fails_an_equal_or_faster_kernel_under_preemption(project_repo):
    """False alarms of :data:`guards.perf.MEAN_SLACK`'s rule on honest kernels: interleaved calls with 5%
    noise and 1% of calls (either side) preempted for 20x their cost: an equal kernel fails in at most 1%
    of 300 seeded trials, a 1.1x faster one never."""
    task = load_task(project_repo, "k3_moe_dispatch")
    equal = sum(perf._mean_regression(task, "cpu", _rec(*_outliers(150, 1.0, s)), s)[2] for s in range(300))
    faster = sum(perf._mean_regression(task, "cpu", _rec(*_outliers(150, 1.1, s)), s)[2] for s in range(300))
    assert equal <= 3, equal
    assert faster == 0, faster


LATE_SLOWDOWN = '''

import time as _time

_LATE_CALLS = {}
_fast_route_dispatch = moe_route_dispatch


def moe_route_dispatch(router_logits, *args, **kwargs):
    """Fast for the first 26 calls of each shape (the judge's window here), then 3 ms of CPU more a call."""
    key = tuple(router_logits.shape)
    _LATE_CALLS[key] = _LATE_CALLS.get(key, 0) + 1
    if _LATE_CALLS[key] > 26:
        t = _time.thread_time()
        while _time.thread_time() - t < 0.003:
            pass
    return _fast_route_dispatch(router_logits, *args, **kwargs)
'''


def test_a_kernel_that_slows_down_after_the_timed_window_fails_its_late_recheck(pristine_repo, tmp_path, monkeypatch):
    """Session 12's red team: kernels fast for their first 100 / 180 calls of a shape, slower afterwards,
    were accepted (no window went past call 170). The late recheck times a claimed and a drawn workload
    again after a random gap, alone, and fails the slowdown there (here: slow from call 15 of a shape,
    the listed workload's window is calls 0-25, its late window 12 pairs: with 6, one landing CI on the
    loaded 2-core machine judged the late pairs inconclusive)."""
    ctx = _candidate(pristine_repo, tmp_path, (pristine_repo / GOOD).read_text() + LATE_SLOWDOWN, "late")
    assert CorrectnessGuard().check(ctx).status is Status.PASS  # records the declared scope (3 calls a shape)
    ctx.task = ctx.task.model_copy(update={"perf": ctx.task.perf.model_copy(update={
        "workloads": ctx.task.perf.workloads[:1], "warmup": 2, "repetitions": 24})})
    monkeypatch.setattr(perf, "PERF_RANDOM_DRAWS", 1)
    monkeypatch.setattr(perf, "PERF_DOMAIN_DRAWS", 0)
    # time every workload whatever load does to the main windows (an early stop skips the late rechecks;
    # seen in session 12's CI on the loaded 2-core machine)
    monkeypatch.setattr(perf, "_fails_on_timings", lambda *a: False)
    v = perf.PerfGuard().check(ctx)
    assert v.status is Status.FAIL, v.summary
    rows = {r["name"]: r for r in ctx.artifacts.perf}
    listed = rows[ctx.task.perf.workloads[0]]
    assert listed["late_recheck_gap"] is not None and "late recheck" in listed["implementation"], (
        listed["verdict"], listed["implementation"], listed["candidate_us"], v.summary)
    # slower on the CPU clock; under load its 3 ms calls are also preempted more than the baseline's (waits)
    assert listed["verdict"] in ("regression", "mean_regression", "no_gain", "waits"), listed["verdict"]
    assert "when timed again late (after " in v.summary, v.summary


def test_the_cuda_event_check_reads_the_judged_windows_events():
    """Session 16's review: a workload judged on its late recheck compared the events of its first window
    (``ev[warmup:]``) with the late window's wall times. Each judged window's events are cut at its own calls
    (a late window follows an untimed gap; a pooled late recheck has two)."""
    ev = [float(i) for i in range(40)]
    assert perf.timed_events(ev, [(5, 12)]) == ev[5:17]
    assert perf.timed_events(ev, [(20, 3), (30, 3)]) == [20.0, 21.0, 22.0, 30.0, 31.0, 32.0]
    assert perf.timed_events(ev, [(38, 5)]) == [38.0, 39.0]  # a short event list is not padded


def test_dropped_or_stretched_cuda_events_are_tampering():
    """The judged calls' events must number their wall samples (a kernel that empties its process's event list
    left nothing to compare) and none may exceed the judge's window around its call."""
    wall = [100.0, 110.0, 105.0, 120.0]
    assert perf.event_tampering([90.0, 99.0, 97.0, 111.0], wall) is None
    assert perf.event_tampering([], wall) == "0 CUDA event(s) for 4 judged call(s): events dropped or added, timer tampering"
    assert "3 CUDA event(s) for 4" in perf.event_tampering([90.0, 99.0, 97.0], wall)
    assert "5 CUDA event(s) for 4" in perf.event_tampering([90.0] * 5, wall)
    assert perf.event_tampering([90.0, 99.0, 97.0, 200.0], wall) == (
        "CUDA events longer than the judge's window: timer tampering")
    assert perf.event_tampering([104.0, 110.0, 105.0, 120.0], wall) is None  # within the 5% slack + 5 us
    assert perf.event_tampering([], []) is None  # nothing judged: nothing to compare


@pytest.mark.slow
def test_a_child_that_stops_answering_is_named_with_the_workload_being_timed(pristine_repo, tmp_path, monkeypatch):
    """A timing child past its deadline fails perf with the workload the children were on (helper-33, session 27:
    a time-out named no configuration)."""
    import guards.judge as judge
    from guards.sandbox import ChildTimeout

    ctx = _candidate(pristine_repo, tmp_path, (pristine_repo / GOOD).read_text(), "hang")
    assert CorrectnessGuard().check(ctx).status is Status.PASS  # records the declared scope
    ctx.task = ctx.task.model_copy(update={"perf": ctx.task.perf.model_copy(update={
        "workloads": ctx.task.perf.workloads[:2], "warmup": 2, "repetitions": 12})})
    for name in ("PERF_RANDOM_DRAWS", "PERF_DOMAIN_DRAWS", "LATE_RECHECKS"):
        monkeypatch.setattr(perf, name, 0)
    real = judge.time_workload

    def hangs_on_the_first(servers, index, *args, **kwargs):  # the first: no timing verdict can stop the loop before
        if index == 0:
            raise ChildTimeout("no acknowledgement before the deadline")
        return real(servers, index, *args, **kwargs)

    monkeypatch.setattr(judge, "time_workload", hangs_on_the_first)
    v = perf.PerfGuard().check(ctx)
    first = ctx.task.perf.workloads[0]
    assert v.status is Status.FAIL and f"while timing {first} (1/2 workloads)" in v.summary, v.summary
