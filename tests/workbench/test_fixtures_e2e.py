"""End to end: every fixture of every task is judged as its folder and name say, through the real
worktree + guards pipeline (CPU)."""

from __future__ import annotations

import json

import pytest

import guards.correctness
from tests.conftest import CPU_GAIN_JUDGINGS, REPO_ROOT, gain_unconfirmed
from workbench.fixtures import fixture_outcome_ok, list_fixtures
from workbench.pipeline import draw_runtime_seed, run_candidate
from workbench.taskspec import list_task_ids, load_task

CASES = [(tid, fx) for tid in list_task_ids(REPO_ROOT) for fx in list_fixtures(load_task(REPO_ROOT, tid))]


# a good fixture's accept rests on a CPU perf gain: its timing runs while nothing else runs
PARAMS = [pytest.param(t, f, id=f"{t}:{f.name}", marks=[pytest.mark.quiet] if f.good else []) for t, f in CASES]


# ---- one run-time seed per task and worker --------------------------------------------------------------------
#
# Every fixture of a task is judged with one run-time seed per pytest worker and session (drawn afresh each
# session, as `workbench run` draws one: never a public seed), so the correctness guard's configurations,
# inputs and reference outputs, a deterministic function of (task, seed), are computed once per worker
# (tests/conftest.py ``correctness_derived_once``); every fixture is still judged on exactly what a
# judgment of its own with that seed computes.

_SEEDS: dict[str, int] = {}


def _session_seed(task_id: str) -> int:
    if task_id not in _SEEDS:
        _SEEDS[task_id] = draw_runtime_seed(load_task(REPO_ROOT, task_id))
    return _SEEDS[task_id]


@pytest.fixture
def shared_derivations(correctness_derived_once, monkeypatch, request):
    """The correctness guard's cases and reference computed once per worker (tests/conftest.py); the shrinking
    of a failure on random draws only (report evidence, after the FAIL is decided) gets one child run instead
    of 8: its search is tested in tests/guards/test_correctness_shrink.py, and one run still exercises it here.
    The model eval's standard leg runs once per worker and task (tests/conftest.py ``model_eval_standard_once``),
    except for the fixtures the model eval must reject (``model_eval-*``), which run both children."""
    monkeypatch.setattr(guards.correctness, "SHRINK_CHILD_RUNS", 1)
    if "model_eval" not in request.node.nodeid:
        request.getfixturevalue("model_eval_standard_once")


@pytest.mark.slow
@pytest.mark.parametrize("task_id, fx", PARAMS)
def test_fixture_judged_as_named(project_repo, shared_derivations, task_id, fx):
    if not fx.runs_on("cpu"):  # e.g. a Triton kernel: judged on CUDA (bench/results/h200/), never here
        pytest.skip(f"fixture {fx.name} is judged on {fx.devices} only (fixtures/requires.toml)")
    src = project_repo / (fx.defined_in or fx.path).relative_to(REPO_ROOT)  # an inject file: judged as given
    result, path = run_candidate(project_repo, task_id, str(src), device="cpu", seed=_session_seed(task_id))
    failure = result.first_failure()
    judging = 1
    while fx.good and gain_unconfirmed(failure) and judging < CPU_GAIN_JUDGINGS:
        # a CPU gain that one timing on a noisy 2-core machine did not confirm (session 20: 1.12x with the
        # interval down to 0.97): judged again, pooled with the earlier judgings (workbench/retries.py), as a
        # user re-runs; a real regression stays one (pooling narrows the interval, it does not move it)
        result, path = run_candidate(project_repo, task_id, str(src), device="cpu", seed=_session_seed(task_id))
        failure = result.first_failure()
        judging += 1
    assert result.seed == _session_seed(task_id)
    assert fixture_outcome_ok(fx, result.accepted, failure.guard if failure else None), (
        f"{fx.name} (seed {result.seed}): accepted={result.accepted}, first failure={failure and failure.one_line()}")
    # the result file on disk is the same document, with a report beside it
    data = json.loads(path.read_text())
    assert data["accepted"] == result.accepted and data["schema_version"] == 2
    assert path.with_suffix(".md").read_text().startswith(f"# {task_id}: {result.acceptance_label}\n")
    if fx.good:
        # every guard passes; model_eval may SKIP, only for a task whose op the model never calls, and perf
        # only for a task that judges performance on other devices (its task.toml says why)
        task = load_task(REPO_ROOT, task_id)
        assert all(v.status.value == "PASS"
                   or (v.guard == "model_eval" and v.status.value == "SKIP" and "never calls op" in v.summary)
                   or (v.guard == "perf" and v.status.value == "SKIP" and "cpu" not in task.perf.devices)
                   for v in result.verdicts), [v.one_line() for v in result.verdicts]
        if task_id == "k3_moe_dispatch":
            assert next(v for v in result.verdicts if v.guard == "model_eval").status.value == "PASS"
        assert all(c.passed for c in result.cases)
        # the kernel ran wherever the task times it and its scope claims (a CUDA fixture judged on decode steps
        # leaves a task's verification workloads to the standard path); a kernel declaring shape rules
        # (SCOPE.shapes) leaves the configurations outside them to the standard path, which the activation
        # guard has checked. On CPU every good fixture claims every listed perf workload.
        claimed = {p.name for p in result.perf if p.verdict != "not_claimed"} if result.perf else set(task.perf.workloads)
        assert result.device != "cpu" or set(task.perf.workloads) <= claimed, (sorted(claimed), task.perf.workloads)
        assert all(c.implementation == "latency_specialized" for c in result.cases if c.name in claimed
                   and c.name in task.perf.workloads)
        # a gain where it is claimed (the listed workloads); the run-time draws are judged for regressions only
        assert all(p.speedup > 1.0 for p in result.perf if p.verdict != "not_claimed" and not p.name.startswith("random-"))
        assert all(p.verdict in ("gain", "neutral", "not_claimed") for p in result.perf), [
            (p.name, p.verdict, p.speedup) for p in result.perf]
    else:
        assert failure.evidence, "a FAIL must carry evidence"
        assert "\n" not in failure.summary  # one line says why
        later = result.verdicts[[v.guard for v in result.verdicts].index(failure.guard) + 1:]
        assert all(v.status.value == "SKIP" for v in later)  # first FAIL stops the run


def test_every_task_has_good_and_bad_fixtures():
    for tid in list_task_ids(REPO_ROOT):
        fxs = list_fixtures(load_task(REPO_ROOT, tid))
        assert any(f.good for f in fxs) and any(not f.good for f in fxs), tid


def test_device_only_fixtures_are_declared_and_skipped_elsewhere():
    fxs = {f.name: f for f in list_fixtures(load_task(REPO_ROOT, "k3_moe_dispatch"))}
    assert fxs["triton-cuda"].devices == ("cuda",) and not fxs["triton-cuda"].runs_on("cpu")
    assert fxs["cutedsl-cuda"].devices == ("cuda",) and not fxs["cutedsl-cuda"].runs_on("cpu")  # CuTe DSL
    assert fxs["lean-torch-cpu"].runs_on("cpu") and not fxs["lean-torch-cpu"].runs_on("cuda")
    assert fxs["perf-slower"].devices is None and fxs["perf-slower"].runs_on("cuda")
