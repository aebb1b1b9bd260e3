"""The perf judge's input draws (``guards.judge._draws``): in batches on threads for large inputs, the same values
as one by one, all drawn before the batch's first call, and the call after a batch's draws alternates between
baseline-first and candidate-first pairs."""

from __future__ import annotations

import threading

import pytest
import torch

from guards import judge


def _make(log: list):
    def make_inputs(i: int) -> dict:
        log.append((i, threading.current_thread().name))
        g = torch.Generator().manual_seed(1000 + i)
        return {"x": torch.randn(64, generator=g)}
    return make_inputs


@pytest.mark.parametrize("first, n", [(0, 10), (7, 8), (20, 1), (3, 3)])
def test_batched_draws_give_the_values_of_one_by_one_draws_before_each_batch(first, n):
    calls = range(first, first + n)
    one_by_one = [_make([])(i) for i in calls]
    log: list = []
    with judge._draws(_make(log), calls, parallel=True) as draw:
        got = []
        for i in calls:
            before = {c for c, _ in log}
            got.append(draw(i))
            drawn = {c for c, _ in log} - before
            # a call not yet drawn starts a batch: it and the next ones (up to DRAW_BATCH, within the window) are
            # all drawn before it returns; the others were drawn with their batch
            if i in before:
                assert drawn == set()
            else:
                assert drawn == set(range(i, min(i + judge.DRAW_BATCH, calls.stop)))
    assert all(torch.equal(a["x"], b["x"]) for a, b in zip(got, one_by_one))
    assert sorted(c for c, _ in log) == list(calls)  # each call drawn once
    assert all(name.startswith("wb-perf-draw") for _, name in log)


def test_the_call_after_each_batch_alternates_which_side_goes_first():
    # time_workload orders call i baseline-first when i is even; an odd batch makes the first call of
    # successive batches alternate, so neither side is timed right after the draws more often
    assert judge.DRAW_BATCH % 2 == 1
    for first in (0, 1, 170, 171):
        starts = list(range(first, first + 150, judge.DRAW_BATCH))
        baseline_first = sum(1 for s in starts if s % 2 == 0)
        assert abs(baseline_first - (len(starts) - baseline_first)) <= 1


def test_small_inputs_are_drawn_at_the_call_on_the_judges_thread():
    log: list = []
    with judge._draws(_make(log), range(5), parallel=False) as draw:
        for i in range(5):
            draw(i)
            assert log[-1][0] == i
    assert {name for _, name in log} == {threading.current_thread().name}


def test_a_draw_that_raises_reaches_the_caller():
    def bad(i: int) -> dict:
        raise ValueError(f"no inputs for call {i}")

    with pytest.raises(ValueError, match="no inputs for call 4"), judge._draws(bad, range(4, 9), parallel=True) as draw:
        draw(4)
