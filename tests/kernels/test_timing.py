"""The timing harness: structure (CPU, with a recording fake of torch.cuda) and behaviour (GPU).

Each known way GPU timing goes wrong (issue 3) has a test showing it absent: a synchronize inside
the timed window, a warm L2 overstating bandwidth, work not captured into a CUDA graph (replay times
nothing, stale outputs pass), work escaping to a side stream, and times below the physical floor.
"""

from __future__ import annotations

import pytest
import torch

from kernels import timing

HAS_CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------- CPU: structure of the timer


class _Recorder:
    """Stands in for torch.cuda's events and synchronize; logs the order of calls."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.clock = 0.0
        names = iter(("start", "stop", "fence") * 1000)
        rec = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.name = next(names)
                self.t = None

            def record(self) -> None:
                rec.log.append(f"{self.name}.record")
                rec.clock += 1.0
                self.t = rec.clock

            def synchronize(self) -> None:
                rec.log.append(f"{self.name}.synchronize")

            def elapsed_time(self, other) -> float:  # milliseconds, as torch
                return (other.t - self.t) * 1e-3

        self.Event = Event

    def synchronize(self) -> None:
        self.log.append("device_synchronize")


def test_no_host_synchronize_inside_the_timed_window(monkeypatch):
    """Regression: the old timer synchronized between the call and the end event (a 4 us kernel
    read as tens of us). Between start.record and stop.record only the call may run."""
    rec = _Recorder()
    monkeypatch.setattr(torch.cuda, "Event", rec.Event)
    monkeypatch.setattr(torch.cuda, "synchronize", rec.synchronize)
    monkeypatch.setattr(timing, "flush_l2", lambda: rec.log.append("flush_l2"))
    side = timing.SideTiming()
    timing._CudaTimer(flush=True)(lambda: rec.log.append("call"), side)
    assert rec.log == ["flush_l2", "device_synchronize", "start.record", "call", "stop.record",
                       "device_synchronize", "fence.record", "fence.synchronize"]
    assert side.samples_us == [pytest.approx(1.0)]  # one fake tick per record: 1e-3 ms
    assert side.tails_us == [pytest.approx(1.0)]


def test_interleaving_alternates_sides_and_wall_clock_bounds_samples():
    order: list[str] = []
    a, b, wall = timing.time_interleaved(lambda: order.append("A"), lambda: order.append("B"),
                                         device="cpu", warmup=2, repetitions=4)
    assert order == ["A", "B"] * 2 + ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert len(a) == len(b) == 4
    assert sum(a) + sum(b) <= wall * 1e6


def test_time_pair_rejects_graphs_on_cpu_and_unknown_devices():
    with pytest.raises(ValueError, match="cuda_graph"):
        timing.time_pair(lambda: None, lambda: None, device="cpu", warmup=0, repetitions=1, cuda_graph=True)
    with pytest.raises(ValueError, match="not cpu or cuda"):
        timing.time_pair(lambda: None, lambda: None, device="tpu", warmup=0, repetitions=1)


def test_floor_is_bandwidth_or_launch_bound():
    # 4.3e9 bytes at 4300 GB/s = 1000 us; a tiny op is launch-bound
    assert timing.floor_us(4_300_000_000, bandwidth_gbps=4300.0, launch_us=3.0) == pytest.approx(1000.0)
    assert timing.floor_us(4_300, bandwidth_gbps=4300.0, launch_us=3.0) == pytest.approx(3.0)
    assert timing.below_floor(2.0, 3.0) and not timing.below_floor(2.8, 3.0)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        timing.floor_us(1, bandwidth_gbps=0.0, launch_us=1.0)


def test_min_bytes_counts_every_tensor_once():
    ts = [torch.zeros(3, 5), torch.zeros(7, dtype=torch.int32), torch.zeros(2, dtype=torch.bool)]
    assert timing.min_bytes(ts) == 3 * 5 * 4 + 7 * 4 + 2


# --------------------------------------------------------- CPU: the perf guard's physical checks


def _stats(cand_median):
    return {"candidate_median_us": cand_median, "verdict": "gain"}


def test_perf_guard_rejects_a_median_below_the_physical_floor():
    from guards.perf import physical_checks

    s = physical_checks(_stats(1.0), {"floor_us": 3.0, "baseline_tails_us": [5.0], "candidate_tails_us": [5.0]})
    assert s["verdict"] == "below_floor" and s["floor_us"] == 3.0


def test_perf_guard_rejects_work_left_on_a_side_stream():
    from guards.perf import physical_checks

    tails = {"floor_us": 3.0, "baseline_tails_us": [6.0, 7.0, 6.5], "candidate_tails_us": [60.0, 61.0, 59.0]}
    s = physical_checks(_stats(10.0), tails)
    assert s["verdict"] == "side_stream" and s["tail_excess_us"] == pytest.approx(53.5)
    ok = physical_checks(_stats(10.0), {**tails, "candidate_tails_us": [7.0, 8.0, 6.0]})
    assert ok["verdict"] == "gain" and ok["tail_excess_us"] == pytest.approx(0.5)


def test_perf_guard_physical_checks_skip_on_cpu_entries():
    from guards.perf import physical_checks

    s = physical_checks(_stats(0.001), {})
    assert s["verdict"] == "gain" and s["floor_us"] is None and s["tail_excess_us"] is None


# ------------------------------------------------------------- GPU: the failure modes, measured


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_sync_inside_window_would_inflate_a_tiny_kernel():
    x = torch.zeros(1, device="cuda")
    f = lambda: x.add_(1.0)  # noqa: E731
    r = timing.time_pair(f, f, device="cuda", warmup=20, repetitions=100, flush_l2=False, cuda_graph=True)
    ours = sorted(r.baseline.samples_us)[50]
    naive = []
    for _ in range(100):  # the old way: host synchronize before the end event
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        s.record()
        f()
        torch.cuda.synchronize()
        e.record()
        e.synchronize()
        naive.append(s.elapsed_time(e) * 1e3)
    naive_med = sorted(naive)[50]
    assert ours < 30.0, f"one tiny kernel replayed from a graph took {ours:.1f} us"
    assert naive_med > ours, (naive_med, ours)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_flushed_l2_never_reports_more_than_dram_bandwidth():
    lim = timing.device_limits()
    n = 8 * 2**20 // 4  # 8 MiB in + 8 MiB out: fits the L2 when warm
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    f = lambda: y.copy_(x)  # noqa: E731
    cold = timing.time_pair(f, f, device="cuda", warmup=10, repetitions=100, flush_l2=True, cuda_graph=True)
    warm = timing.time_pair(f, f, device="cuda", warmup=10, repetitions=100, flush_l2=False, cuda_graph=True)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    gbps_cold = 2 * n * 4 / med(cold.baseline.samples_us) / 1e3
    gbps_warm = 2 * n * 4 / med(warm.baseline.samples_us) / 1e3
    assert gbps_cold <= 1.1 * lim.copy_gbps, (gbps_cold, lim.copy_gbps)
    assert gbps_warm > gbps_cold  # the effect the flush removes is real on this device


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_graph_with_uncaptured_work_is_rejected():
    x = torch.randn(1000, device="cuda")
    out = torch.empty_like(x)

    def skips_under_capture():
        if not torch.cuda.is_current_stream_capturing():
            torch.mul(x, 2.0, out=out)

    with pytest.raises(timing.TimingError, match="unwritten"):
        timing.capture_graph(skips_under_capture, outputs=[out])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_graph_with_stale_outputs_is_rejected_and_a_real_one_passes():
    x = torch.randn(1000, device="cuda")
    out = torch.empty_like(x)
    snapshot = x * 2.0

    def replays_a_constant():
        if torch.cuda.is_current_stream_capturing():
            out.copy_(snapshot)  # captured: a copy of the values seen at capture time
        else:
            torch.mul(x, 2.0, out=out)

    def refresh():
        x.copy_(torch.randn(1000, device="cuda"))

    with pytest.raises(timing.TimingError, match="stale"):
        timing.capture_graph(replays_a_constant, outputs=[out], refresh_inputs=refresh)
    g = timing.capture_graph(lambda: torch.mul(x, 2.0, out=out), outputs=[out], refresh_inputs=refresh)
    refresh()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x * 2.0)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_work_left_on_a_side_stream_shows_in_the_tail():
    from guards.perf import TAIL_EXCESS_ABS_US, physical_checks
    from kernels.stats import median

    side = torch.cuda.Stream()
    x = torch.zeros(1, device="cuda")

    def honest():
        x.add_(1.0)

    def escapes():
        x.add_(1.0)
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000)  # about 100 us of spinning the timed stream never waits for

    r = timing.time_pair(honest, escapes, device="cuda", warmup=5, repetitions=40, flush_l2=False)
    excess = median(r.candidate.tails_us) - median(r.baseline.tails_us)
    assert excess > 3 * TAIL_EXCESS_ABS_US
    s = physical_checks({"candidate_median_us": median(r.candidate.samples_us), "verdict": "gain"},
                        {"baseline_tails_us": r.baseline.tails_us, "candidate_tails_us": r.candidate.tails_us})
    assert s["verdict"] == "side_stream"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_gpu_device_limits_are_physical():
    lim = timing.device_limits()
    assert 500.0 < lim.copy_gbps < 10_000.0
    assert 0.5 < lim.graph_launch_us <= lim.launch_us < 100.0
