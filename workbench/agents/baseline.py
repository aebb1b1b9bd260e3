"""The standard path's quick timing for the brief: each perf workload's median and spread, and how it was measured.

A median alone misleads: an agent reading "116 us"
cannot tell a steady number from a rough one (issue 20: 116-125 ms quoted, 52-80 ms measured by the
judge on a loaded machine). :func:`time_baseline` runs a quick timing child and keeps the 10th
and 90th percentiles of the samples and the method, so the brief can say both.

Source: issue 20 item 5 ("the baseline's measured medians with their spread and how they were measured").
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path

from workbench.taskspec import TaskSpec

logger = logging.getLogger("workbench.agents.baseline")

SPREAD_QUANTILES = (0.1, 0.9)
"""Quantiles of the samples quoted as the spread (fraction): the 10th-90th percentile range."""


@dataclasses.dataclass(frozen=True)
class BaselineTiming:
    """One perf workload's standard-path timing.

    Attributes:
        median_us: median of the samples (microseconds).
        p10_us, p90_us: 10th and 90th percentiles of the samples (microseconds).
        samples: timed calls behind these numbers (count, both timed sides together).
    """

    median_us: float
    p10_us: float
    p90_us: float
    samples: int

    @property
    def spread_pct(self) -> float:
        """Width of the 10th-90th percentile range relative to the median (percent)."""
        return 100.0 * (self.p90_us - self.p10_us) / self.median_us if self.median_us > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class BaselineTimings:
    """The quick baseline of a task on one device.

    Attributes:
        device: ``cpu`` or ``cuda``.
        timer: the clock the quick child read (``thread CPU time in the child`` or ``CUDA events``).
        seed: the public seed the inputs were drawn from.
        warmup, repetitions: untimed and timed calls per side (count).
        workloads: perf workload name -> its timing (empty: not measured).
    """

    device: str
    timer: str
    seed: int
    warmup: int
    repetitions: int
    workloads: dict[str, BaselineTiming]


def quantile(samples: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``samples`` by linear interpolation between order statistics.

    Raises:
        ValueError: ``samples`` is empty or ``q`` is outside [0, 1].

    Source: Hyndman & Fan (1996), definition 7 (numpy's default ``linear`` method).
    """
    if not samples:
        raise ValueError("quantile of no samples: time at least one call.")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile q={q}: must lie in [0, 1].")
    xs = sorted(float(x) for x in samples)
    h = (len(xs) - 1) * q
    lo = int(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def summarize(samples: Sequence[float]) -> BaselineTiming:
    """Median, 10th and 90th percentiles of ``samples`` (microseconds).

    Raises:
        ValueError: ``samples`` is empty.
    """
    lo, hi = SPREAD_QUANTILES
    return BaselineTiming(median_us=round(quantile(samples, 0.5), 2), p10_us=round(quantile(samples, lo), 2),
                          p90_us=round(quantile(samples, hi), 2), samples=len(samples))


def time_baseline(worktree: Path, task: TaskSpec, *, device: str, repetitions: int = 20,
                  warmup: int = 5) -> BaselineTimings:
    """Time the standard path on both sides of the quick perf child, per perf workload, on the first public seed.

    The child runs the base worktree with ``decode_backend="standard"`` (no candidate code runs) and the
    spread of the samples is kept.

    Args:
        worktree: a checkout of the base commit.
        task: the task spec.
        device: ``cpu`` or ``cuda``.
        repetitions: timed calls per side (calls).
        warmup: untimed calls per side (calls).

    Returns:
        The timings; ``workloads`` is empty for distributed tasks, where the task does not judge
        performance on ``device``, and when the timing child failed (logged).
    """
    seed = task.correctness.public_seeds[0] if task.correctness.public_seeds else 0
    timer = "thread CPU time in the child" if device == "cpu" else "CUDA events in the child"
    out = BaselineTimings(device=device, timer=timer, seed=seed, warmup=warmup, repetitions=repetitions, workloads={})
    if task.distributed is not None or device not in task.perf.devices:
        logger.info("no quick baseline for %s on %s (distributed task or perf not judged on this device)",
                    task.task_id, device)
        return out
    from guards.cases import build_case
    from guards.sandbox import run_child

    cases = [build_case(task, task.workload(n), seed) for n in task.perf.workloads]
    request = {"mode": "perf", "target": task.target, "op": task.op, "device": device, "decode_backend": "standard",
               "cases": [c.request_entry() for c in cases], "perf": {"warmup": warmup, "repetitions": repetitions}}
    outcome = run_child(Path(worktree), request, timeout_s=task.timeouts.perf_s,
                        memory_bytes=task.timeouts.memory_bytes, device=device)
    if outcome.response is None or not outcome.response.get("ok"):
        logger.warning("baseline timing failed: %s", outcome.problem or outcome.response.get("error"))
        return out
    for p in outcome.response.get("perf", []):
        samples = [float(x) for x in p["baseline_us"]] + [float(x) for x in p["candidate_us"]]
        if samples:
            out.workloads[p["name"]] = summarize(samples)
    return out


__all__ = ["BaselineTiming", "BaselineTimings", "SPREAD_QUANTILES", "quantile", "summarize", "time_baseline"]
