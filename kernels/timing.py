"""One timing harness for the perf guard and the benchmarks: candidate and baseline interleaved.

CPU: the calling thread's CPU clock (``time.thread_time_ns``) around each call, so load from other
processes does not leak into the samples (the guard's child runs torch with one intra-op thread).
CUDA, per timed call:

1. the L2 is flushed (a buffer of at least twice the L2 is zero-filled) outside the timed window,
   so a working set left warm by the previous call cannot overstate bandwidth; the device is idle
   when the window opens, so an eager call's host launch overhead is counted, not hidden;
2. ``start`` is recorded, the callable runs (eager, or one replay of its captured CUDA graph),
   ``stop`` is recorded on the same stream: ``stop - start`` is the sample. No host synchronize sits
   inside this window (a ``torch.cuda.synchronize()`` there adds the host's wake-up and relaunch
   latency: a 4 us kernel read as tens of us);
3. then a device-wide ``torch.cuda.synchronize()`` and a third event ``fence``: ``fence - stop`` is the
   call's *tail*. Work the callable left on another stream finishes before ``fence`` and lengthens the
   tail, so a candidate whose tail exceeds the baseline's has pushed work outside the timed window
   (side streams cannot escape unseen).

Both sides alternate (A B, then B A, ...) after warm-up so drift hits them equally; the wall clock of
the whole batch is returned as a cross-check (the samples cannot add up to more than it).

CUDA-graph mode (``cuda_graph=True``, for launch-bound ops) captures each callable once and times
``graph.replay()``; :func:`capture_graph` checks that a replay really rewrites the outputs with fresh
results (poisoned before the replay, inputs changed, compared with an eager call), so a graph into
which nothing was captured cannot time nothing and pass with stale outputs.

:func:`device_limits` measures the copy bandwidth and the one-launch time of the device;
:func:`floor_us` turns bytes moved into the physical floor ``max(bytes / bandwidth, launch)``, below
which a measured time is impossible.

Source: issue 3 "GPU timing in kernels/"; METHOD.md (events, warm-up, rotate/flush caches, graphs);
the CUDA Programming Guide on events and stream capture.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence

import torch

L2_FLUSH_MIN_BYTES = 128 * 2**20
"""Smallest flush buffer (bytes): over twice the H200's 60 MB L2 (and any current NVIDIA L2)."""

FLOOR_SLACK = 0.9
"""A median below ``FLOOR_SLACK * floor`` is rejected as impossible (10% for timer granularity)."""


class TimingError(RuntimeError):
    """The timing itself is not trustworthy (uncaptured graph, stale outputs, impossible time)."""


# ----------------------------------------------------------------------------------------- L2 flush


@functools.lru_cache(maxsize=8)
def _flush_buffer(device_index: int) -> torch.Tensor:
    props = torch.cuda.get_device_properties(device_index)
    l2 = int(getattr(props, "L2_cache_size", 0) or 0)
    nbytes = max(L2_FLUSH_MIN_BYTES, 2 * l2)
    return torch.empty(nbytes // 4, dtype=torch.int32, device=f"cuda:{device_index}")


def flush_l2() -> None:
    """Evict the L2 by zero-filling a buffer of ``max(128 MiB, 2 x L2)`` on the current stream."""
    _flush_buffer(torch.cuda.current_device()).zero_()


# ------------------------------------------------------------------------------------- CUDA graphs


def capture_graph(
    fn: Callable[[], object],
    *,
    outputs: Sequence[torch.Tensor] = (),
    refresh_inputs: Callable[[], None] | None = None,
    warmup: int = 3,
    verify: Callable[[], Sequence[str]] | None = None,
) -> torch.cuda.CUDAGraph:
    """Capture ``fn`` into a CUDA graph and prove that a replay recomputes ``outputs``.

    Args:
        fn: zero-argument callable reading and writing fixed (static) tensors.
        outputs: the tensors ``fn`` writes; checked after a replay when given.
        refresh_inputs: writes new data into ``fn``'s static inputs (same storage); when given, the
            replay after it must match an eager call on the same new data.
        warmup: eager calls on a side stream before capture (allocator and lazy init, as PyTorch asks).
        verify: optional; called after the replay on refreshed inputs, returns mismatch lines (e.g. the
            task's checker against its reference); used instead of the comparison with an eager call,
            for ops whose contract leaves an order free.

    Returns:
        The captured graph.

    Raises:
        TimingError: a replay left an output element unwritten (still poisoned) or stale (different
            from the eager result on refreshed inputs): the work was not captured.

    Source: PyTorch "CUDA Graphs" notes (warm up on a side stream, static inputs and outputs).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    if outputs:
        check_graph_replay(graph, fn, outputs, refresh_inputs, verify)
    return graph


def _poison(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(-7777)


def _unwritten(t: torch.Tensor) -> int:
    if t.dtype.is_floating_point:
        return int(torch.isnan(t).sum())
    if t.dtype == torch.bool:
        return 0  # a bool output cannot be poisoned distinguishably; checked against eager instead
    return int((t == -7777).sum())


def check_graph_replay(
    graph: torch.cuda.CUDAGraph,
    fn: Callable[[], object],
    outputs: Sequence[torch.Tensor],
    refresh_inputs: Callable[[], None] | None = None,
    verify: Callable[[], Sequence[str]] | None = None,
) -> None:
    """Poison ``outputs``, replay, and require every element rewritten (and, with new inputs, fresh).

    Args:
        graph: the captured graph of ``fn``.
        fn: the eager callable (run once on the refreshed inputs to get the expected outputs).
        outputs: tensors the graph must write.
        refresh_inputs: optional; writes new data into the static inputs before the replay. Outputs
            that two eager calls on the same data write differently are checked as written only.
        verify: optional; after the replay on refreshed inputs, returns mismatch lines (empty: fresh);
            replaces the comparison with an eager call.

    Raises:
        TimingError: an output element is still poisoned after the replay, or differs from the
            eager result on the refreshed inputs.
    """
    if refresh_inputs is not None and verify is None:
        refresh_inputs()
        fn()
        torch.cuda.synchronize()
        expected = [o.clone() for o in outputs]
        fn()  # a second eager call: outputs that legitimately differ between calls (e.g. an order left
        torch.cuda.synchronize()  # free by the contract, set by atomics) are only checked as written
        deterministic = [torch.equal(o, e) or (o.dtype.is_floating_point and bool(torch.equal(o.isnan(), e.isnan())
                         and torch.allclose(o, e, equal_nan=True))) for o, e in zip(outputs, expected)]
    if refresh_inputs is not None and verify is not None:
        refresh_inputs()
    for o in outputs:
        _poison(o)
    graph.replay()
    torch.cuda.synchronize()
    for i, o in enumerate(outputs):
        n = _unwritten(o)
        if n:
            raise TimingError(
                f"CUDA graph replay left {n} of {o.numel()} elements of output {i} unwritten: the op's work "
                "was not captured into the graph (it ran outside capture or on another stream); "
                "time it eagerly or make it capturable."
            )
    if verify is not None:
        msgs = list(verify())
        if msgs:
            raise TimingError(f"CUDA graph replay on new inputs is wrong or stale: {msgs[0]} "
                              f"({len(msgs)} mismatch lines); the graph does not recompute the op.")
    elif refresh_inputs is not None:
        for i, (o, e) in enumerate(zip(outputs, expected)):
            if not deterministic[i]:
                continue
            same = torch.equal(o, e) if not o.dtype.is_floating_point else bool(
                torch.allclose(o, e, rtol=1e-5, atol=1e-6, equal_nan=True))
            if not same:
                raise TimingError(
                    f"CUDA graph replay wrote stale output {i}: it differs from an eager call on the new "
                    "inputs, so the graph does not recompute the op (values cached at capture time)."
                )


# -------------------------------------------------------------------------------------- the timer


@dataclasses.dataclass
class SideTiming:
    """Per-call samples of one side.

    Attributes:
        samples_us: ``stop - start`` of each timed call (microseconds).
        tails_us: ``fence - stop`` after a device-wide sync (microseconds; CUDA only).
    """

    samples_us: list[float] = dataclasses.field(default_factory=list)
    tails_us: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class PairTiming:
    """Result of :func:`time_pair`.

    Attributes:
        baseline, candidate: the two sides' samples.
        wall_s: wall-clock seconds of the whole timed loop (cross-check: samples sum below it).
        flush_l2: whether the L2 was flushed before each timed call.
        cuda_graph: whether graph replays were timed.
        timer: ``cuda_event`` or ``cpu_thread_time``.
    """

    baseline: SideTiming
    candidate: SideTiming
    wall_s: float
    flush_l2: bool
    cuda_graph: bool
    timer: str


def _cpu_call_us(fn: Callable[[], object], side: SideTiming) -> None:
    t0 = time.thread_time_ns()  # this thread's CPU time: other processes on the machine do not inflate it
    fn()
    side.samples_us.append((time.thread_time_ns() - t0) / 1e3)


def _cpu_wall_call_us(fn: Callable[[], object], side: SideTiming) -> None:
    # a collective spends its time waiting for peers and in the backend's own threads, which the
    # calling thread's CPU clock never sees: distributed CPU calls are timed by the wall clock
    t0 = time.perf_counter_ns()
    fn()
    side.samples_us.append((time.perf_counter_ns() - t0) / 1e3)


class _CudaTimer:
    """Events reused across calls; one pending set per call, read after the device-wide sync."""

    def __init__(self, flush: bool, before_call: Callable[[], object] | None = None) -> None:
        self.flush = flush
        self.before_call = before_call

    def __call__(self, fn: Callable[[], object], side: SideTiming) -> None:
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        fence = torch.cuda.Event(enable_timing=True)
        if self.flush:
            flush_l2()
            # idle device at ``start``: an eager call's host launch overhead stays inside the window
            # (otherwise it would hide behind the flush still running on the GPU)
            torch.cuda.synchronize()
        if self.before_call is not None:  # last, so ranks leave it together and start their windows together
            self.before_call()
        start.record()
        fn()
        stop.record()  # the window closes on the timing stream: no host sync inside it
        torch.cuda.synchronize()  # device-wide: side-stream work must finish before the fence
        fence.record()
        fence.synchronize()
        side.samples_us.append(start.elapsed_time(stop) * 1e3)
        side.tails_us.append(stop.elapsed_time(fence) * 1e3)


def time_pair(
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    *,
    device: str,
    warmup: int,
    repetitions: int,
    flush_l2: bool = True,
    cuda_graph: bool = False,
    outputs: Mapping[str, Sequence[torch.Tensor]] | None = None,
    cpu_timer: str = "thread",
    before_call: Callable[[], object] | None = None,
) -> PairTiming:
    """Time two callables alternately (A B, B A, ...) after warm-up.

    Args:
        baseline, candidate: zero-argument callables running one op call each.
        device: ``cpu`` or ``cuda``.
        warmup: untimed calls of each before timing (count).
        repetitions: timed calls of each (count).
        flush_l2: CUDA only; flush the L2 before every timed call.
        cuda_graph: CUDA only; capture each callable once and time its replays.
        outputs: with ``cuda_graph``, ``{"baseline": [...], "candidate": [...]}``, the tensors each
            side writes; each graph must rewrite all of them on replay (see :func:`capture_graph`).
        cpu_timer: CPU only; ``thread`` (the calling thread's CPU clock) or ``wall`` (for collectives,
            whose time is spent waiting and in the backend's threads).
        before_call: run before every timed call, outside its window (a barrier that lines TP
            ranks up, so no rank's sample includes waiting for a late peer).

    Returns:
        A :class:`PairTiming` (samples in microseconds).

    Raises:
        ValueError: unknown device, or ``cuda_graph`` on the CPU.
        TimingError: a captured graph does not rewrite its outputs.
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"time_pair: device {device!r} is not cpu or cuda.")
    if cuda_graph and device != "cuda":
        raise ValueError("time_pair: cuda_graph=True needs device='cuda'.")
    fns = {"baseline": baseline, "candidate": candidate}
    for _ in range(warmup):
        baseline()
        candidate()
    if device == "cuda":
        torch.cuda.synchronize()
        if cuda_graph:
            outs = outputs or {}
            graphs = {k: capture_graph(f, outputs=outs.get(k, ()), warmup=1) for k, f in fns.items()}
            fns = {k: g.replay for k, g in graphs.items()}
            for _ in range(max(1, warmup // 4)):
                fns["baseline"]()
                fns["candidate"]()
            torch.cuda.synchronize()
    if cpu_timer not in ("thread", "wall"):
        raise ValueError(f"time_pair: cpu_timer {cpu_timer!r} is not thread or wall.")
    base_timer = _CudaTimer(flush_l2, before_call) if device == "cuda" else (
        _cpu_call_us if cpu_timer == "thread" else _cpu_wall_call_us)
    if before_call is None or device == "cuda":
        timer = base_timer
    else:
        def timer(fn: Callable[[], object], side: SideTiming) -> None:
            before_call()
            base_timer(fn, side)
    a, b = SideTiming(), SideTiming()
    t0 = time.perf_counter()
    for i in range(repetitions):
        if i % 2 == 0:
            timer(fns["baseline"], a)
            timer(fns["candidate"], b)
        else:
            timer(fns["candidate"], b)
            timer(fns["baseline"], a)
    wall_s = time.perf_counter() - t0
    return PairTiming(a, b, wall_s, flush_l2 and device == "cuda", cuda_graph,
                      "cuda_event" if device == "cuda" else f"cpu_{cpu_timer}_time".replace("cpu_wall_time", "cpu_wall_clock"))


def time_interleaved(
    baseline: Callable[[], object],
    candidate: Callable[[], object],
    *,
    device: str,
    warmup: int,
    repetitions: int,
    flush_l2: bool = True,
    details: dict | None = None,
    cpu_timer: str = "thread",
    before_call: Callable[[], object] | None = None,
) -> tuple[list[float], list[float], float]:
    """Time two callables alternately; the perf guard's entry point (see :func:`time_pair`).

    Args:
        baseline, candidate: zero-argument callables running one op call each.
        device: ``cpu`` or ``cuda``.
        warmup: untimed calls of each before timing (count).
        repetitions: timed calls of each (count).
        flush_l2: CUDA only; flush the L2 before every timed call.
        details: when given, filled with ``tails_us`` per side (CUDA: time from the end of the call to
            a fence after a device-wide sync, microseconds) and ``flush_l2``.
        cpu_timer, before_call: see :func:`time_pair`.

    Returns:
        ``(baseline_us, candidate_us, wall_s)``: per-call samples (microseconds) and the wall-clock
        seconds of the whole timed loop (a cross-check: the samples cannot sum to more than it).
    """
    r = time_pair(baseline, candidate, device=device, warmup=warmup, repetitions=repetitions, flush_l2=flush_l2,
                  cpu_timer=cpu_timer, before_call=before_call)
    if details is not None:
        details.update(baseline_tails_us=r.baseline.tails_us, candidate_tails_us=r.candidate.tails_us,
                       flush_l2=r.flush_l2, timer=r.timer)
    return r.baseline.samples_us, r.candidate.samples_us, r.wall_s


# ------------------------------------------------------------------------------ physical floors


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """Measured ceilings of the current device.

    Attributes:
        copy_gbps: device-to-device copy bandwidth, bytes read plus written (GB/s, 1e9 bytes/s).
        launch_us: median event time of one launch of a one-element kernel, eager, timed as every
            other call (L2 flushed, idle device at the window's start) (microseconds).
        graph_launch_us: the same kernel replayed as a one-node CUDA graph (microseconds).
    """

    copy_gbps: float
    launch_us: float
    graph_launch_us: float

    def to_dict(self) -> dict[str, float]:
        """JSON-ready form."""
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=4)
def device_limits(device_index: int | None = None, copy_bytes: int = 2 * 2**30) -> DeviceLimits:
    """Measure copy bandwidth and launch time once per process and device.

    Args:
        device_index: CUDA device (default: current).
        copy_bytes: size of each of the two copy buffers (bytes); several times the L2.

    Returns:
        :class:`DeviceLimits`.

    Source: METHOD.md "Two numbers first" (measure the copy ceiling on the machine itself).
    """
    dev = torch.device("cuda", torch.cuda.current_device() if device_index is None else device_index)
    with torch.cuda.device(dev):
        n = copy_bytes // 4
        x = torch.empty(n, dtype=torch.float32, device=dev).uniform_()
        y = torch.empty_like(x)
        for _ in range(3):
            y.copy_(x)
        times = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            y.copy_(x)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e-3)
        times.sort()
        gbps = 2 * copy_bytes / times[len(times) // 2] / 1e9
        del x, y
        tiny = torch.zeros(1, device=dev)

        def one() -> None:
            tiny.add_(1.0)

        # same conditions as the timings the floor bounds (flush + idle device at the window's start):
        # without the flush the GPU idles between calls, its clocks drop and a launch reads slower
        # (H200, bench/results/h200: 16.3 us unflushed vs 13.8 us for a whole flushed kernel call)
        eager = time_pair(one, one, device="cuda", warmup=20, repetitions=100, flush_l2=True)
        graph = time_pair(one, one, device="cuda", warmup=20, repetitions=100, flush_l2=True, cuda_graph=True)
        med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
        return DeviceLimits(copy_gbps=gbps, launch_us=med(eager.baseline.samples_us + eager.candidate.samples_us),
                            graph_launch_us=med(graph.baseline.samples_us + graph.candidate.samples_us))


def min_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Fewest bytes an op must move: each input read once, each output written once (bytes)."""
    return int(sum(t.numel() * t.element_size() for t in tensors))


def floor_us(nbytes: int, *, bandwidth_gbps: float, launch_us: float) -> float:
    """Physical floor of one call: ``max(bytes / bandwidth, one launch)`` (microseconds).

    Args:
        nbytes: bytes moved through device memory (see :func:`min_bytes`).
        bandwidth_gbps: measured copy bandwidth (GB/s).
        launch_us: measured time of one launch in the same timing mode (microseconds).

    Raises:
        ValueError: a non-positive bandwidth.
    """
    if bandwidth_gbps <= 0:
        raise ValueError(f"floor_us: bandwidth_gbps must be > 0; got {bandwidth_gbps}.")
    return max(nbytes / (bandwidth_gbps * 1e3), launch_us)


def below_floor(median_us: float, floor: float) -> bool:
    """Whether a measured median is physically impossible (below ``FLOOR_SLACK`` x the floor)."""
    return median_us < FLOOR_SLACK * floor
