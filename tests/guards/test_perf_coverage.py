"""Where the perf guard looks: the run-time perf draws against the declared scope.

Session 7's red team got two kernels accepted that are slow only where perf never times: at expert
counts no perf workload uses (E = 384: 0.24x) and on steps with padding rows (0.20x; every padded
CUDA-graph decode step has them). Perf now also draws configurations over the whole [domain] (the
timed regimes); the tests below hold it to that, and the bad fixtures perf-slow-only-on-padding-rows
and perf-slow-only-at-unlisted-expert-counts are rejected end to end (tests/workbench/test_fixtures_e2e.py).
"""

from __future__ import annotations

import pytest

from guards.perf import PERF_DOMAIN_DRAWS, PERF_RANDOM_DRAWS, perf_workloads, timed_overlays, timed_regimes
from tests.conftest import REPO_ROOT
from workbench.taskspec import load_task

SEEDS = range(20)
LEAN_CLAIM = {"devices": ["cpu"], "phases": ["decode", "spec_verify"], "requests_min": 1, "requests_max": 64,
              "query_len_min": 1, "query_len_max": 8}
"""The scope the moe_dispatch fixtures built on lean-torch-cpu declare: the perf draws follow the claim."""


@pytest.fixture(scope="module")
def moe():
    return load_task(REPO_ROOT, "k3_moe_dispatch")


@pytest.mark.slow
def test_listed_workloads_come_first_and_draws_redraw_the_batch_inside_the_scope(moe):
    for seed in SEEDS:
        ws = perf_workloads(moe, seed, claimed=LEAN_CLAIM)
        assert [w.name for w in ws[:len(moe.perf.workloads)]] == list(moe.perf.workloads)
        drawn = [w for w in ws[len(moe.perf.workloads):] if not w.name.startswith("random-perf-domain-")]
        assert len(drawn) == PERF_RANDOM_DRAWS and all(w.name.startswith("random-perf-") for w in drawn)
        listed_t = {moe.workload(n).axes["T"] for n in moe.perf.workloads}
        assert all(w.axes["T"] not in listed_t for w in drawn)
        # one decode step (the largest listed decode step's other sizes, T redrawn in 1-64), one verification step
        # (mini_r64_d7's, T redrawn in 1-512 at Q = 8): a kernel slow off the timed batches is met on both
        decode, verify = drawn
        assert decode.axes["Q"] == 1 and 1 <= decode.axes["T"] <= 64 and decode.name.endswith("-k3_t64")
        assert verify.axes["Q"] == 8 and 1 <= verify.axes["T"] <= 512 and verify.name.endswith("-mini_r64_d7")
        assert (decode.phase, verify.phase) == ("decode", "spec_verify")
        assert moe.scope.step(verify.axes, verify.phase)[0] == "spec_verify"
    decode_only = perf_workloads(moe, 3, claimed={**LEAN_CLAIM, "phases": ["decode"], "query_len_max": 1})
    assert all(w.axes["Q"] == 1 for w in decode_only[len(moe.perf.workloads):])


def test_perf_domain_draws_time_expert_counts_and_block_sizes_no_listed_workload_times(moe):
    """Session 7's red team: a kernel slow only at E = 384 (0.24x) was accepted, perf redrew only T.
    The domain draws time every axis; with the listed workloads counted as covered they reach the
    expert counts, group counts and block sizes the list leaves out (the bad fixture
    perf-slow-only-at-unlisted-expert-counts is rejected end to end)."""
    listed = [moe.workload(n) for n in moe.perf.workloads]
    listed_e = {w.axes["E"] for w in listed}
    per_seed_missing = []
    for seed in SEEDS:
        ws = perf_workloads(moe, seed, claimed=LEAN_CLAIM)
        drawn = [w for w in ws if w.name.startswith("random-perf-domain-")]
        assert len(drawn) == PERF_DOMAIN_DRAWS
        assert all(w.axes["T"] <= 64 * w.axes["Q"] for w in drawn)  # in the task's scope: at most 64 requests
        assert all(moe.domain.satisfied({**w.axes, **w.params}) for w in drawn)
        assert {w.axes["B"] for w in ws} == {16, 32, 64, 128} and {w.axes["G"] for w in ws} == {1, 2, 4, 8}, seed
        assert len({w.axes["E"] for w in drawn} - listed_e) >= PERF_DOMAIN_DRAWS - 2, seed
        per_seed_missing.append(set(moe.domain.axes["E"].choices) - {w.axes["E"] for w in ws})
    # over the seeds every expert count is timed in most runs. With verification steps a drawn dimension (issue 21,
    # session 22): over these 20 seeds at most two left out per run, E = 384 in 2 runs (over seeds 0-99: at most
    # three, E = 384 in 8; a kernel slow at every unlisted E, as the bad fixture, meets 6 or more in every run)
    assert all(len(m) <= 2 for m in per_seed_missing), per_seed_missing
    assert sum(384 in m for m in per_seed_missing) <= 2, per_seed_missing


@pytest.mark.slow
def test_perf_domain_draws_time_steps_with_padding_rows_in_every_run(moe):
    """Session 7's red team: a kernel slow only on steps with padding rows (0.20x) was accepted; the
    padding_rows overlay is ``timed`` (every padded CUDA-graph step has them), so every run times it."""
    assert timed_regimes(moe) == ("realistic",)
    assert timed_overlays(moe) == ("padding_rows",)
    for seed in SEEDS:
        cases = [w.case.split(":")[0] for w in perf_workloads(moe, seed, claimed=LEAN_CLAIM)]  # padding_rows:<rows>
        assert "realistic+padding_rows" in cases, seed
        assert set(cases) <= {"realistic", "realistic+padding_rows"}  # edge regimes (ties, denormals) never timed


def test_perf_domain_draws_are_regression_only_and_off_for_the_estimate(moe):
    ws = perf_workloads(moe, 1, draws=0, domain_draws_n=0)
    assert [w.name for w in ws] == list(moe.perf.workloads)
    assert perf_workloads(moe, 1) == perf_workloads(moe, 1)  # deterministic per seed
    assert perf_workloads(moe, 1) != perf_workloads(moe, 2)
    allreduce = load_task(REPO_ROOT, "k3_allreduce_rmsnorm")
    assert [w.name for w in perf_workloads(allreduce, 1)] == list(allreduce.perf.workloads)  # distributed: listed only


@pytest.mark.parametrize("task_id", ["k3_kda_decode", "k3_small_m_gemm", "k3_lse_merge", "k3_moe_dispatch",
                                     "k3_dspark_verify"])
def test_perf_batch_draws_meet_the_domain_constraints(task_id):
    """Session 23: kda_decode's verification template (a pool of S = 9 slots) had its batch redrawn to 56
    requests, which its inputs cannot hold (S >= B + 1), and the perf guard ERRORed on an honest kernel.
    Batch draws keep every domain constraint with the template's other axes."""
    task = load_task(REPO_ROOT, task_id)
    claimed = {"query_len_min": task.scope.query_len_min, "query_len_max": task.scope.query_len_max}
    for seed in range(20):
        for w in perf_workloads(task, seed, claimed=claimed):
            assert task.domain.satisfied({**w.axes, **w.params}, cost=False), (seed, w.name, dict(w.axes))


def test_perf_batch_draws_cost_no_more_than_their_template_or_the_cost_cap():
    """Session 23's review: lse_merge's verification template (64 rows at 96 heads) was redrawn to ~500 rows,
    50M elements a call, above the cost ceiling; the judge keeps every call's outputs. A batch draw now costs
    at most its template, or stays under the cost constraints."""
    task = load_task(REPO_ROOT, "k3_lse_merge")
    claimed = {"query_len_min": 1, "query_len_max": 8}
    listed = {w.name: w for w in task.correctness.workloads}
    for seed in range(10):
        for w in perf_workloads(task, seed, claimed=claimed):
            if not w.name.startswith("random-perf-") or w.name.startswith("random-perf-domain-"):
                continue
            tmpl = listed[w.name.split("-", 3)[3]]
            values = {**w.axes, **w.params}
            assert w.axes["B"] <= tmpl.axes["B"] or task.domain.satisfied(values), (seed, w.name, dict(w.axes))
