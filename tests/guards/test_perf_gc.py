"""The perf child keeps Python's cyclic garbage collector off while serving and ends every call with a
collection inside the call's own timed window (``guards/_child_main.py`` ``_serve``)."""

from __future__ import annotations

import pytest

import guards.perf as perf
from guards.correctness import CorrectnessGuard
from guards.verdict import Status
from tests.guards.test_guard_units import GOOD, _candidate

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
    assert max(row["baseline_us"]) < 3000.0
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
