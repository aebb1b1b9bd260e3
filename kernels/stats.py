"""Statistics for timing comparisons: medians, bootstrap intervals, a rank test.

Everything works on plain Python sequences of per-call times (any unit, both sides the same).

Sources: Efron & Tibshirani, "An Introduction to the Bootstrap" (1993), percentile interval;
Mann & Whitney (1947), U test with the normal approximation and tie correction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


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
    return _percentile_interval(torch.where(mb > 0, ma / mb, torch.full_like(ma, math.inf)), confidence)


def bootstrap_mean_ratio_ci(
    num: Sequence[float], den: Sequence[float], *, confidence: float = 0.99, resamples: int = 1000, seed: int = 0
) -> tuple[float, float, float]:
    """``mean(num) / mean(den)`` and its percentile bootstrap interval (samples resampled independently).

    The mean counts every sample at its size: a few slow calls among many fast ones move it, where they
    leave a median untouched.

    Args:
        num, den: non-empty samples (e.g. candidate and baseline wall times per call, microseconds).
        confidence: two-sided level in (0, 1).
        resamples: bootstrap resamples.
        seed: RNG seed (the interval is reproducible).

    Returns:
        ``(ratio, low, high)``.

    Raises:
        ValueError: an empty sample, or a non-positive mean of ``den``.
    """
    import torch

    if not num or not den:
        raise ValueError("bootstrap_mean_ratio_ci needs two non-empty samples.")
    a = torch.tensor(list(num), dtype=torch.float64)
    b = torch.tensor(list(den), dtype=torch.float64)
    if float(b.mean()) <= 0:
        raise ValueError(f"bootstrap_mean_ratio_ci: the denominator's mean is {float(b.mean())}, not positive.")
    g = torch.Generator().manual_seed(seed)
    ma = a[torch.randint(0, a.numel(), (resamples, a.numel()), generator=g)].mean(dim=1)
    mb = b[torch.randint(0, b.numel(), (resamples, b.numel()), generator=g)].mean(dim=1)
    lo, hi = _percentile_interval(torch.where(mb > 0, ma / mb, torch.full_like(ma, math.inf)), confidence)
    return float(a.mean() / b.mean()), lo, hi


def bootstrap_median_ci(
    xs: Sequence[float], *, confidence: float = 0.99, resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``median(xs)`` (same method as :func:`bootstrap_ratio_ci`).

    Args:
        xs: a non-empty sample (e.g. per-step times, microseconds).
        confidence: two-sided level in (0, 1).
        resamples: bootstrap resamples.
        seed: RNG seed (the interval is reproducible).

    Returns:
        ``(low, high)`` in the unit of ``xs``; both equal the value for a sample of one.

    Raises:
        ValueError: an empty sample.
    """
    import torch

    if not xs:
        raise ValueError("bootstrap_median_ci needs a non-empty sample.")
    g = torch.Generator().manual_seed(seed)
    a = torch.tensor(list(xs), dtype=torch.float64)
    return _percentile_interval(_median_rows(a[torch.randint(0, a.numel(), (resamples, a.numel()), generator=g)]),
                                confidence)


def _percentile_interval(stats, confidence: float) -> tuple[float, float]:
    """The two-sided percentile interval of the 1-D bootstrap statistics ``stats`` (a tensor) at ``confidence``."""
    s = stats.sort().values
    n = s.numel()
    lo_i = int(math.floor((1 - confidence) / 2 * n))
    hi_i = min(n - 1, int(math.ceil((1 + confidence) / 2 * n)) - 1)
    return float(s[lo_i]), float(s[hi_i])


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


def paired_ratio_ci(
    num: Sequence[float], den: Sequence[float], *, confidence: float = 0.99, resamples: int = 2000, seed: int = 0
) -> tuple[float, tuple[float, float]]:
    """Median of per-pair ratios ``num[i] / den[i]`` and its percentile bootstrap interval.

    For interleaved timing (A B A B), pair i was measured back to back, so machine-wide drift and
    bursts of load from other processes hit both sides of a pair alike and cancel in the ratio.

    Args:
        num, den: equally long paired samples (e.g. baseline and candidate times, microseconds).
        confidence: two-sided level in (0, 1).
        resamples: bootstrap resamples over pairs.
        seed: RNG seed.

    Returns:
        ``(median_ratio, (low, high))``.

    Raises:
        ValueError: empty or unequal samples, or a non-positive time.
    """
    import torch

    if not num or len(num) != len(den):
        raise ValueError(f"paired_ratio_ci needs two equally long non-empty samples; got {len(num)} and {len(den)}.")
    a = torch.tensor(list(num), dtype=torch.float64)
    b = torch.tensor(list(den), dtype=torch.float64)
    if bool((b <= 0).any()) or bool((a <= 0).any()):
        raise ValueError("paired_ratio_ci: times must be positive.")
    r = a / b
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, r.numel(), (resamples, r.numel()), generator=g)
    return float(_median_rows(r.unsqueeze(0))[0]), _percentile_interval(_median_rows(r[idx]), confidence)


def wilcoxon_greater(x: Sequence[float], y: Sequence[float]) -> float:
    """One-sided p-value that paired ``x[i]`` tend to exceed ``y[i]`` (signed-rank test on log ratios,
    normal approximation with tie correction; zero differences dropped).

    Source: Wilcoxon (1945); the log makes the test scale-free for times.

    Raises:
        ValueError: unequal or empty samples.
    """
    if not x or len(x) != len(y):
        raise ValueError("wilcoxon_greater needs two equally long non-empty samples.")
    d = [math.log(a) - math.log(b) for a, b in zip(x, y) if a != b]
    n = len(d)
    if n == 0:
        return 0.5
    order = sorted(range(n), key=lambda i: abs(d[i]))
    ranks = [0.0] * n
    tie_term = 0.0
    i = 0
    while i < n:
        j = i
        while j + 1 < n and abs(d[order[j + 1]]) == abs(d[order[i]]):
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        t = j - i + 1
        tie_term += t**3 - t
        i = j + 1
    w_plus = sum(r for r, v in zip(ranks, d) if v > 0)
    mu = n * (n + 1) / 4
    sigma = math.sqrt(n * (n + 1) * (2 * n + 1) / 24 - tie_term / 48)
    if sigma == 0:
        return 0.5
    z = (w_plus - mu - 0.5) / sigma
    return 0.5 * math.erfc(z / math.sqrt(2))
