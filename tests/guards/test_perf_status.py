"""PerfStatus: which statuses fail, pool and are load-sensitive, and the validator of each status."""

from __future__ import annotations

import pydantic
import pytest

from guards.perf import FAILING_VERDICTS, LOAD_SENSITIVE, perf_verdict
from guards.perf_status import PerfStatus
from workbench.results import PerfResult
from workbench.retries import POOLED_PERF_VERDICTS


def _entry(verdict: str, **kw) -> dict:
    e = {"name": "w", "axes": {"T": 1}, "implementation": "latency_specialized", "baseline_us": (10.0, 11.0),
         "candidate_us": (5.0, 6.0), "baseline_median_us": 10.5, "candidate_median_us": 5.5, "speedup": 1.9,
         "speedup_ci": (1.5, 2.2), "p_slower": 1.0, "verdict": verdict, "timer": "cpu_thread_time"}
    e.update(kw)
    return e


def test_the_tables_derive_from_the_enum():
    assert set(FAILING_VERDICTS) == {"regression", "no_gain", "below_floor", "side_stream", "tampered",
                                     "wrong_output", "busy_outside", "waits", "raised", "compiled_timed",
                                     "mean_regression"}
    assert set(LOAD_SENSITIVE) == {"regression", "no_gain", "waits", "mean_regression"}
    assert set(POOLED_PERF_VERDICTS) == {"gain", "no_gain", "neutral", "regression"}
    assert [s for s in PerfStatus if s.claimed] == [PerfStatus.GAIN, PerfStatus.NO_GAIN]
    assert PerfStatus("gain") == "gain" and f"{PerfStatus.WAITS}" == "waits"


@pytest.mark.parametrize("verdict,kw,why", [
    ("gain", {"speedup_ci": (0.97, 1.2)}, "interval above 1"),
    ("gain", {"speedup": 0.9, "speedup_ci": (1.01, 1.2)}, "speedup > 1"),
    ("regression", {"speedup": 1.2}, "speedup < 1"),
    ("neutral", {"baseline_us": ()}, "samples of both sides"),
    ("not_claimed", {}, "not timed, yet it has samples"),
    ("below_floor", {}, "needs floor_us"),
    ("side_stream", {}, "needs tail_excess_us"),
    ("busy_outside", {}, "needs candidate_outside_cpu_us"),
    ("waits", {}, "needs wait_excess_us"),
    ("mean_regression", {}, "needs mean_ratio"),
    ("tampered", {}, "name its cause"),
    ("wrong_output", {}, "name its cause"),
    ("raised", {}, "name its cause"),
    ("compiled_timed", {}, "name its cause"),
])
def test_an_entry_that_contradicts_its_status_is_refused(verdict, kw, why):
    e = _entry(verdict, **kw)
    assert why in PerfStatus(verdict).problem(e)
    with pytest.raises(pydantic.ValidationError, match=f"has verdict '{verdict}'"):
        PerfResult(**e)


@pytest.mark.parametrize("verdict,kw", [
    ("gain", {}),
    ("no_gain", {"speedup": 1.02, "speedup_ci": (0.95, 1.1)}),
    ("regression", {"speedup": 0.8, "speedup_ci": (0.7, 0.9)}),
    ("regression", {"speedup": 1.3, "implementation": "x (timer samples exceed the wall clock: timer tampering)"}),
    ("not_claimed", {"baseline_us": (), "candidate_us": ()}),
    ("below_floor", {"floor_us": 8.0}),
    ("side_stream", {"tail_excess_us": 40.0}),
    ("busy_outside", {"candidate_outside_cpu_us": 900.0}),
    ("waits", {"wait_excess_us": 300.0}),
    ("mean_regression", {"mean_ratio": 3.2, "mean_ratio_ci": (2.1, 4.4)}),
    ("wrong_output", {"implementation": "latency_specialized (call 3: topk_ids differ)"}),
])
def test_a_consistent_entry_is_accepted(verdict, kw):
    e = _entry(verdict, **kw)
    assert PerfStatus(verdict).problem(e) is None
    assert PerfResult(**e).verdict is PerfStatus(verdict)
    assert PerfResult(**e).model_dump(mode="json")["verdict"] == verdict


class _Perf:
    min_speedup = 1.05


class _Task:
    perf = _Perf()


def test_the_summary_reads_the_status_description():
    v = perf_verdict(_Task(), [_entry("waits", wait_excess_us=321.0)], ["w"])
    assert v.status.value == "FAIL"
    assert "w is waiting off-CPU inside its calls (321 us more than the baseline per call)" in v.summary
    v = perf_verdict(_Task(), [_entry("no_gain", speedup=1.02, speedup_ci=(0.95, 1.1))], ["w"])
    assert "no real gain (need >= 1.05x with the interval above 1): 1.020x" in v.summary


def test_the_summary_names_the_mean_ratio_of_a_mean_regression():
    v = perf_verdict(_Task(), [_entry("mean_regression", mean_ratio=3.21, mean_ratio_ci=(2.0, 4.0))], ["w"])
    assert v.status.value == "FAIL"
    assert "w is slower on average (3.21x the baseline's mean time per call, wall clock" in v.summary
