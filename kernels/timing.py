"""Timing of one op call, candidate and baseline interleaved (A B A B), on CPU or CUDA.

CPU: the calling thread's CPU clock (``time.thread_time_ns``) around each call, so load from other
processes does not leak into the samples (the child runs torch with one intra-op thread). CUDA: events on the current stream with a
device-wide synchronize before the end event is read, so work left on side streams is counted.

Source: DESIGN.md "Trust model" (timing cross-checked); issue 3 extends this harness (L2 flush,
CUDA graphs, physical floors).
"""

from __future__ import annotations

import time
from typing import Callable

import torch


def _cpu_time_us(fn: Callable[[], object]) -> float:
    # CPU time of this thread, not wall time: other processes on a shared machine do not inflate it.
    # The child pins torch to one intra-op thread (OMP_NUM_THREADS=1), so the op's work is on this thread.
    t0 = time.thread_time_ns()
    fn()
    return (time.thread_time_ns() - t0) / 1e3


def _cuda_time_us(fn: Callable[[], object]) -> float:
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    torch.cuda.synchronize()  # device-wide: side-stream work must finish inside the window
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def time_interleaved(
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    *,
    device: str,
    warmup: int,
    repetitions: int,
) -> tuple[list[float], list[float], float]:
    """Time two callables alternately.

    Args:
        baseline, candidate: zero-argument callables running one op call each.
        device: ``cpu`` or ``cuda``.
        warmup: untimed calls of each before timing.
        repetitions: timed calls of each.

    Returns:
        ``(baseline_us, candidate_us, wall_s)``: per-call samples (microseconds) and the wall-clock
        seconds of the whole timed loop (a cross-check: the samples cannot sum to more than it).
    """
    timer = _cuda_time_us if device == "cuda" else _cpu_time_us
    for _ in range(warmup):
        baseline()
        candidate()
    if device == "cuda":
        torch.cuda.synchronize()
    a: list[float] = []
    b: list[float] = []
    t0 = time.perf_counter()
    for i in range(repetitions):
        # alternate which side goes first so drift (thermal, frequency) hits both equally
        if i % 2 == 0:
            a.append(timer(baseline))
            b.append(timer(candidate))
        else:
            b.append(timer(candidate))
            a.append(timer(baseline))
    wall_s = time.perf_counter() - t0
    return a, b, wall_s
