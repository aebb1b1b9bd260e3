"""What the quick and full self-checks judge (the guards and workloads), without running them."""

from __future__ import annotations

from pathlib import Path

from workbench.agents.selfcheck import (
    QUICK_MAX_INPUT_BYTES,
    input_bytes,
    left_out,
    public_task,
    self_check_guards,
)
from workbench.taskspec import load_task

ROOT = Path(__file__).resolve().parents[2]


def test_quick_task_leaves_out_only_large_workloads_and_times_two_batches():
    task = load_task(ROOT, "k3_dspark_verify")
    quick = public_task(task, quick=True)
    assert left_out(task, quick) == ["k3_b64"]
    assert input_bytes(task, task.workload("k3_b64")) > QUICK_MAX_INPUT_BYTES
    assert all(input_bytes(task, w) <= QUICK_MAX_INPUT_BYTES for w in quick.correctness.workloads)
    assert quick.perf.workloads == ("k3_b1", "v4k_b64_dp")  # smallest and largest batch, task order
    assert quick.correctness.random_draws == 0 and (quick.perf.warmup, quick.perf.repetitions) == (2, 10)
    moe = load_task(ROOT, "k3_moe_dispatch")
    assert left_out(moe, public_task(moe, quick=True)) == []
    assert public_task(moe).perf.workloads == moe.perf.workloads  # not quick: every perf workload


def test_input_bytes_counts_every_input_and_rank():
    task = load_task(ROOT, "k3_allreduce_rmsnorm")
    w2, w4 = task.workload("k3_w2_t64"), task.workload("k3_w4_t64")
    assert input_bytes(task, w4) > input_bytes(task, w2) > 0


def test_quick_and_full_guards_are_the_pipelines_in_its_order():
    task = load_task(ROOT, "k3_moe_dispatch")
    quick = [g.name for g in self_check_guards(task, full=False, with_perf=True)]
    assert quick == ["isolation", "audit", "correctness[seed=0]", "activation", "perf_estimate"]
    full = [g.name for g in self_check_guards(task, full=True, with_perf=False)]
    assert full == ["isolation", "audit", "correctness[seed=0]", "correctness[seed=1]", "correctness[seed=2]",
                    "activation", "model_eval"]
    est = self_check_guards(task, full=False, with_perf=True)[-1]
    assert (est.random_draws, est.extension_rounds) == (0, 0)
