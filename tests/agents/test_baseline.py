"""The brief's quick baseline: medians with their spread, from the standard path only."""

from __future__ import annotations

import pytest

from workbench.agents.baseline import time_baseline
from workbench.taskspec import load_task


@pytest.mark.slow
def test_time_baseline_keeps_the_spread(repo):
    task = load_task(repo, "k3_moe_dispatch")
    b = time_baseline(repo, task, device="cpu", repetitions=6, warmup=1)
    assert (b.device, b.timer, b.seed, b.warmup, b.repetitions) == ("cpu", "thread CPU time in the child", 0, 1, 6)
    assert list(b.workloads) == list(task.perf.workloads)
    for t in b.workloads.values():
        assert t.samples == 12  # both standard-path sides
        assert 0 < t.p10_us <= t.median_us <= t.p90_us
        assert t.spread_pct == 100 * (t.p90_us - t.p10_us) / t.median_us


def test_time_baseline_is_empty_where_no_quick_timing_applies(repo):
    dist = load_task(repo, "k3_allreduce_rmsnorm")  # distributed, and its perf is judged on CUDA only
    assert time_baseline(repo, dist, device="cpu").workloads == {}
