"""``guards.perf.all_close``, the judge's per-call tolerance check on timed outputs, decides exactly as
``torch.isclose(...).all()`` does: on random values, values at their bound, NaN, infinities of either sign,
overflowing differences, empty tensors and half-precision dtypes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from guards.perf import all_close

SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-6, 3.0e38, -3.0e38, math.inf, -math.inf, math.nan]


def _expected(g, w, rtol, atol) -> bool:
    return bool(torch.isclose(g, w, rtol=rtol, atol=atol).all())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(SPECIAL) | st.floats(-1e3, 1e3, width=32),
                          st.sampled_from(SPECIAL) | st.floats(-1e3, 1e3, width=32)), min_size=1, max_size=12),
       st.sampled_from([0.0, 1e-5, 1e-2]), st.sampled_from([0.0, 1e-6, 1e-3]),
       st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
def test_decides_as_isclose(pairs, rtol, atol, dtype):
    g = torch.tensor([p[0] for p in pairs], dtype=torch.float64).to(dtype)
    w = torch.tensor([p[1] for p in pairs], dtype=torch.float64).to(dtype)
    assert all_close(g, w, rtol=rtol, atol=atol) == _expected(g, w, rtol, atol)


@pytest.mark.parametrize("got, want, close", [
    ([1.0, 2.0], [1.0, 2.0], True),
    ([-math.inf], [math.inf], False),  # |got - want| = inf = the bound: isclose says no
    ([1.0], [math.inf], False),
    ([math.inf], [math.inf], True),
    ([math.nan], [math.nan], False),
    ([3.0e38], [-3.0e38], False),  # the difference overflows
    ([], [], True),
])
def test_edges(got, want, close):
    g, w = torch.tensor(got, dtype=torch.float32), torch.tensor(want, dtype=torch.float32)
    assert all_close(g, w, rtol=1e-5, atol=1e-6) is close
    assert _expected(g, w, 1e-5, 1e-6) is close


def test_a_value_just_past_its_bound_fails_and_one_at_it_passes():
    want = torch.full((1000,), 2.0)
    at_bound = want + (1e-3 + 1e-2 * 2.0)
    assert all_close(at_bound, want, rtol=1e-2, atol=1e-3) == _expected(at_bound, want, 1e-2, 1e-3)
    past = at_bound.clone()
    past[517] = torch.nextafter(past[517], torch.tensor(math.inf))
    past[517] += 1e-3
    assert not all_close(past, want, rtol=1e-2, atol=1e-3)
    assert all_close(want.t() if want.dim() > 1 else want[::2], want[::2], rtol=0.0, atol=0.0)  # strided views


def test_the_perf_judge_takes_the_baselines_very_bits_without_the_canonical_form():
    """``_same_answer``: outputs equal to the baseline's bit for bit are the same answer without the task's
    ``canonical`` form (its sorts cost the judge ~1 ms a call for MoE); other bits still go through it."""
    from guards.perf import _same_answer

    seen = []

    def canonical(outputs, params):
        seen.append(1)
        return {k: v.sort().values for k, v in outputs.items()}

    base = {"ids": torch.tensor([3, 1, 2])}
    assert _same_answer({"ids": base["ids"].clone()}, base, canonical, {}, {}) and seen == []
    assert _same_answer({"ids": torch.tensor([1, 2, 3])}, base, canonical, {}, {}) and len(seen) == 2
    assert not _same_answer({"ids": torch.tensor([1, 2, 4])}, base, canonical, {}, {})


def test_tensors_of_other_shapes_or_dtypes_are_refused():
    with pytest.raises(ValueError, match="compare outputs of one shape and dtype"):
        all_close(torch.empty(0), torch.ones(3), rtol=0.0, atol=0.0)  # empty against three values: never "close"
    with pytest.raises(ValueError, match="float64"):
        all_close(torch.ones(3), torch.ones(3, dtype=torch.float64), rtol=0.0, atol=0.0)
