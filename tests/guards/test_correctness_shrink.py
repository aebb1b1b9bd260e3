"""A failure found only by random draws is shrunk to a smaller failing configuration in the report
(issue 19: "shrinking to a minimal failing case in the report")."""

from __future__ import annotations

import pytest

from guards.correctness import CorrectnessGuard
from guards.isolation import IsolationGuard
from workbench.pipeline import judge_candidate
from workbench.taskspec import load_task
from workbench.worktree import create_candidate

FIXTURE = "tasks/k3_moe_dispatch/fixtures/bad/correctness-wrong-only-at-block-32-ungrouped.inject.toml"


@pytest.mark.slow
def test_random_only_failure_is_shrunk_and_stays_in_the_failing_cell(project_repo):
    task = load_task(project_repo, "k3_moe_dispatch")
    cand = create_candidate(project_repo, task.task_id, str(project_repo / FIXTURE))
    result, _ = judge_candidate(project_repo, task, cand, device="cpu", seed=11,
                                guards=[IsolationGuard(), CorrectnessGuard()])
    v = result.first_failure()
    assert v is not None and v.guard == "correctness", [x.one_line() for x in result.verdicts]
    failed = [c for c in result.cases if not c.passed]
    assert failed and all(c.name.startswith("random-") for c in failed)  # no fixed workload reaches the bug
    shrunk = next(e for e in v.evidence if e.name == "shrunk")
    assert "shrunk to" in v.summary, v.summary
    first = failed[0]
    # the bug lives at block size 32 without groups: the shrunk configuration keeps both, and is smaller
    assert "'B': 32" in shrunk.value and "'G': 1" in shrunk.value, shrunk
    t_shrunk = int(shrunk.value.split("'T': ")[1].split(",")[0])
    assert t_shrunk <= first.axes["T"] and shrunk.path, (shrunk, first.axes)
