"""Statistics behind the perf guard, calibrated on synthetic CPU-like timing noise.

The noise model: per-call times ~ median * lognormal(0, 0.05) with 3% outliers up to 3x
(what CPU timing of a ~100 us op looks like on a shared machine). A/A must rarely alarm;
a 10% slowdown (twice the 5% threshold) must almost always be caught.
"""

from __future__ import annotations

import math
import random

import pytest

from guards.perf import classify
from kernels.stats import bootstrap_ratio_ci, mann_whitney_greater, median


def _samples(rng: random.Random, med: float, n: int = 150) -> list[float]:
    out = []
    for _ in range(n):
        x = med * math.exp(rng.gauss(0, 0.05))
        if rng.random() < 0.03:
            x *= 1 + 2 * rng.random()
        out.append(x)
    return out


KW = dict(max_regression_pct=5.0, min_speedup=1.05, confidence=0.99, alpha=0.01)


def test_median_and_errors():
    assert median([3, 1, 2]) == 2 and median([4, 1, 2, 3]) == 2.5
    with pytest.raises(ValueError):
        median([])


def test_bootstrap_interval_brackets_the_true_ratio():
    rng = random.Random(1)
    a, b = _samples(rng, 120.0), _samples(rng, 100.0)
    lo, hi = bootstrap_ratio_ci(a, b, confidence=0.99, resamples=1000)
    assert lo < 1.2 < hi and hi - lo < 0.08


def test_mann_whitney_direction():
    rng = random.Random(2)
    slow, fast = _samples(rng, 110.0), _samples(rng, 100.0)
    assert mann_whitney_greater(slow, fast) < 1e-6
    assert mann_whitney_greater(fast, slow) > 0.99


def test_aa_false_alarm_rate_at_most_2pct():
    rng = random.Random(3)
    alarms = sum(classify(_samples(rng, 100.0), _samples(rng, 100.0), claimed=False, seed=i, **KW)["verdict"]
                 == "regression" for i in range(100))
    assert alarms <= 2


def test_planted_10pct_slowdown_detected_95pct():
    rng = random.Random(4)
    hits = sum(classify(_samples(rng, 100.0), _samples(rng, 110.0), claimed=False, seed=i, **KW)["verdict"]
               == "regression" for i in range(100))
    assert hits >= 95


def test_claimed_path_needs_a_real_gain():
    rng = random.Random(5)
    same = classify(_samples(rng, 100.0), _samples(rng, 100.0), claimed=True, **KW)
    assert same["verdict"] == "no_gain"
    faster = classify(_samples(rng, 100.0), _samples(rng, 80.0), claimed=True, **KW)
    assert faster["verdict"] == "gain" and faster["speedup"] == pytest.approx(1.25, rel=0.05)
    assert faster["speedup_ci"][0] > 1.0
