"""``workbench bench``'s template workload (workbench/bench.py ``template_workload``, ``batch_fits``): the
sweep's batches 1-64 must fit the template's other sizes under the task's [domain] constraints."""

from __future__ import annotations

from pathlib import Path

from workbench.bench import DEFAULT_BATCHES, batch_fits, template_workload
from workbench.taskspec import load_task

ROOT = Path(__file__).resolve().parents[2]


def test_kda_template_has_a_state_slot_for_every_row_of_the_sweep():
    """kda_decode's first perf workloads (k3_b1, k3_b8) hold 3 and 9 slots: batch 64 needs 65 (S >= B + 1,
    the H200 bench of session 16 failed on B = 4 with k3_b1's slots), so the template is mini_b64."""
    task = load_task(ROOT, "k3_kda_decode")
    assert not batch_fits(task, task.workload("k3_b8"), 9) and batch_fits(task, task.workload("k3_b8"), 8)
    name = template_workload(task, DEFAULT_BATCHES)
    assert name == "mini_b64"
    assert all(batch_fits(task, task.workload(name), b) for b in DEFAULT_BATCHES)
    assert template_workload(task, (1, 2, 4, 8)) == "k3_b8"  # K3 sizes where they fit


def test_tasks_without_such_constraints_keep_their_first_perf_workload():
    for tid in ("k3_moe_dispatch", "k3_lse_merge", "k3_dspark_verify"):
        task = load_task(ROOT, tid)
        assert template_workload(task, DEFAULT_BATCHES) == task.perf.workloads[0], tid
