"""Statistics behind the perf guard, calibrated on synthetic CPU-like timing noise.

Noise model for interleaved pairs: a load factor shared by both calls of a pair (other processes on
a 2-core machine: 20% of pairs slowed by up to 2x), independent per-call noise lognormal(0, 0.05),
and 3% single-call outliers up to 3x. A/A must rarely alarm; a 10% slowdown (twice the 5%
threshold) must almost always be caught; a claimed gain needs a real one.
"""

from __future__ import annotations

import math
import random

import pytest

from guards.perf import classify
from kernels.stats import (
    bootstrap_median_ci,
    bootstrap_ratio_ci,
    mann_whitney_greater,
    median,
    paired_ratio_ci,
    wilcoxon_greater,
)


def _pairs(rng: random.Random, base: float, cand: float, n: int = 150) -> tuple[list[float], list[float]]:
    a, b = [], []
    for _ in range(n):
        load = 1 + rng.random() if rng.random() < 0.2 else 1.0
        for med, out in ((base, a), (cand, b)):
            x = med * load * math.exp(rng.gauss(0, 0.05))
            if rng.random() < 0.03:
                x *= 1 + 2 * rng.random()
            out.append(x)
    return a, b


KW = dict(max_regression_pct=5.0, min_speedup=1.05, confidence=0.99, alpha=0.01)


def test_median_and_errors():
    assert median([3, 1, 2]) == 2 and median([4, 1, 2, 3]) == 2.5
    with pytest.raises(ValueError):
        median([])
    with pytest.raises(ValueError, match="equally long"):
        paired_ratio_ci([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        paired_ratio_ci([1.0], [0.0])


def test_paired_interval_brackets_the_true_ratio_and_beats_unpaired():
    rng = random.Random(1)
    a, b = _pairs(rng, 120.0, 100.0)
    r, (lo, hi) = paired_ratio_ci(a, b, confidence=0.99, resamples=1000)
    assert lo < 1.2 < hi and r == pytest.approx(1.2, rel=0.03)
    ulo, uhi = bootstrap_ratio_ci(a, b, confidence=0.99, resamples=1000)
    assert hi - lo < uhi - ulo  # shared load cancels within pairs


def test_rank_tests_direction():
    rng = random.Random(2)
    slow, fast = _pairs(rng, 110.0, 100.0)
    assert wilcoxon_greater(slow, fast) < 1e-6 and wilcoxon_greater(fast, slow) > 0.99
    assert mann_whitney_greater(slow, fast) < 0.05 and mann_whitney_greater(fast, slow) > 0.95
    assert wilcoxon_greater([1.0, 2.0], [1.0, 2.0]) == 0.5


@pytest.mark.slow
def test_aa_false_alarm_rate_at_most_1pct():
    rng = random.Random(3)
    alarms = sum(classify(*_pairs(rng, 100.0, 100.0), claimed=False, seed=i, **KW)["verdict"] == "regression"
                 for i in range(200))
    assert alarms <= 2


def test_planted_10pct_slowdown_detected_95pct():
    rng = random.Random(4)
    hits = sum(classify(*_pairs(rng, 100.0, 110.0), claimed=False, seed=i, **KW)["verdict"] == "regression"
               for i in range(100))
    assert hits >= 95


def test_claimed_path_needs_a_real_gain():
    rng = random.Random(5)
    assert classify(*_pairs(rng, 100.0, 100.0), claimed=True, **KW)["verdict"] == "no_gain"
    assert classify(*_pairs(rng, 100.0, 98.0), claimed=True, **KW)["verdict"] == "no_gain"  # 2% is not 5%
    faster = classify(*_pairs(rng, 100.0, 80.0), claimed=True, **KW)
    assert faster["verdict"] == "gain" and faster["speedup"] == pytest.approx(1.25, rel=0.03)
    assert faster["speedup_ci"][0] > 1.0


def test_median_interval_brackets_the_median_and_narrows_with_more_samples():
    rng = random.Random(5)
    small = [100 + rng.gauss(0, 5) for _ in range(20)]
    big = [100 + rng.gauss(0, 5) for _ in range(400)]
    lo, hi = bootstrap_median_ci(small)
    assert lo <= median(small) <= hi and lo < hi
    blo, bhi = bootstrap_median_ci(big)
    assert 97 < blo <= median(big) <= bhi < 103 and bhi - blo < hi - lo
    assert bootstrap_median_ci([7.0]) == (7.0, 7.0)
    with pytest.raises(ValueError):
        bootstrap_median_ci([])
