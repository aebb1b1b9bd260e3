"""Statistics for timing comparisons: medians, bootstrap intervals, a rank test.

Everything works on plain Python sequences of per-call times (any unit, both sides the same).

Sources: Efron & Tibshirani, "An Introduction to the Bootstrap" (1993), percentile interval;
Mann & Whitney (1947), U test with the normal approximation and tie correction.
"""

from __future__ import annotations

import math
from typing import Sequence


def median(xs: Sequence[float]) -> float:
    """Median of a non-empty sequence.

    Raises:
        ValueError: empty input.
    """
    if not xs:
        raise ValueError("median of an empty sample; time at least one call.")
    s = sorted(xs)
    n = len(s)
    return float(s[n // 2]) if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def bootstrap_ratio_ci(
    num: Sequence[float], den: Sequence[float], *, confidence: float = 0.99, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``median(num) / median(den)``.

    Args:
        num, den: independent samples (e.g. baseline and candidate times, microseconds).
        confidence: two-sided level in (0, 1).
        resamples: bootstrap resamples.
        seed: RNG seed (the interval is reproducible).

    Returns:
        ``(low, high)`` bounds of the ratio.

    Raises:
        ValueError: an empty sample.
    """
    import torch

    if not num or not den:
        raise ValueError("bootstrap_ratio_ci needs two non-empty samples.")
    g = torch.Generator().manual_seed(seed)
    a = torch.tensor(list(num), dtype=torch.float64)
    b = torch.tensor(list(den), dtype=torch.float64)
    ia = torch.randint(0, a.numel(), (resamples, a.numel()), generator=g)
    ib = torch.randint(0, b.numel(), (resamples, b.numel()), generator=g)
    ma = _median_rows(a[ia])
    mb = _median_rows(b[ib])
    ratios = torch.where(mb > 0, ma / mb, torch.full_like(ma, math.inf)).sort().values
    lo_i = int(math.floor((1 - confidence) / 2 * resamples))
    hi_i = min(resamples - 1, int(math.ceil((1 + confidence) / 2 * resamples)) - 1)
    return float(ratios[lo_i]), float(ratios[hi_i])


def _median_rows(x):
    """Row-wise median with the two middle values averaged for even lengths (like :func:`median`)."""
    s = x.sort(dim=1).values
    n = s.shape[1]
    return s[:, n // 2] if n % 2 else 0.5 * (s[:, n // 2 - 1] + s[:, n // 2])


def mann_whitney_greater(x: Sequence[float], y: Sequence[float]) -> float:
    """One-sided p-value that values in ``x`` tend to be larger than in ``y`` (U test, normal approx.).

    Returns:
        p in [0, 1]; small p means ``x`` is stochastically larger (e.g. candidate slower than baseline).
    """
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        raise ValueError("mann_whitney_greater needs two non-empty samples.")
    pooled = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    ranks = [0.0] * len(pooled)
    tie_term = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        r = (i + j) / 2 + 1
        for k in range(i, j + 1):
            ranks[k] = r
        t = j - i + 1
        tie_term += t**3 - t
        i = j + 1
    r1 = sum(r for r, (_, g) in zip(ranks, pooled) if g == 0)
    u1 = r1 - n1 * (n1 + 1) / 2
    mu = n1 * n2 / 2
    n = n1 + n2
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1)))) if n > 1 else 0.0
    if sigma == 0:
        return 0.5
    z = (u1 - mu - 0.5) / sigma  # continuity correction
    return 0.5 * math.erfc(z / math.sqrt(2))
