"""The brief and the feedback: what they say, and that no run-time seed ever appears in them."""

from __future__ import annotations

import pytest

from guards.verdict import Evidence, Status, Verdict
from workbench.agents.brief import redact, render_brief, render_feedback
from workbench.agents.pricing import cost_usd, price_for
from workbench.results import CandidateInfo, CaseResult, RunResult
from workbench.taskspec import load_task

SEED = 1234567891


@pytest.fixture
def task(repo):
    return load_task(repo, "k3_moe_dispatch")


def test_brief_contents(repo, task):
    text = render_brief(task, repo_root=repo, worktree=repo, base_commit="a" * 40, device="cpu",
                        baseline_us={"k3_t1": 212.04, "k3_t64": 850.5}, mode="shell")
    assert "`k3_model/kernels/moe_dispatch/**`" in text
    assert "`k3_model.ops.moe_dispatch:moe_route_dispatch`" in text
    assert "- `topk_ids` (output): shape (T, K) int32" in text
    assert "batch axis `T` in [1, 64]" in text
    assert "- `k3_t1`: 212.0 us per call" in text and "- `k3_t64`: 850.5 us per call" in text
    assert f"workbench check k3_moe_dispatch --base {'a' * 40}" in text
    assert "Never weaken a check" in text  # AGENTS.md
    assert "public seeds [0, 1, 2]" in text
    assert f"{task.correctness.random_draws} configurations drawn at judging time" in text
    tools = render_brief(task, repo_root=repo, worktree=repo, base_commit="a" * 40, device="cpu", baseline_us=None,
                         mode="tools")
    assert "`run_check` tool" in tools and "workbench check k3_moe_dispatch --base" not in tools
    assert "Baseline medians: not measured for this run." in tools


def _result(seed: int) -> RunResult:
    fail = Verdict(guard="correctness", status=Status.FAIL, summary="1 of 29 configurations wrong; first: random-3-k3_t8 (T=41).",
                   evidence=(Evidence(name="mismatch", value=f"[a_fresh] topk_ids differ (seed {seed})", path="random-3-k3_t8"),))
    return RunResult(
        result_id="r", task_id="k3_moe_dispatch", task_spec_sha256="0" * 64,
        candidate=CandidateInfo(source="wb/k3_moe_dispatch/1", kind="branch", branch="wb/k3_moe_dispatch/1",
                                worktree="/w", base_commit="b" * 40, candidate_commit="c" * 40,
                                changed_paths=("k3_model/kernels/moe_dispatch/__init__.py",)),
        environment={}, device="cpu",
        verdicts=(Verdict(guard="isolation", status=Status.PASS, summary="ok."), fail,
                  Verdict(guard="activation", status=Status.SKIP, summary="Not run: correctness did not pass.")),
        accepted=False,
        cases=(CaseResult(name="random-3-k3_t8", axes={"T": 41, "E": 896}, params={}, case="realistic",
                          implementation="latency_specialized", passed=False, mismatches=("[a_fresh] topk_ids differ",)),),
        command=f"workbench verify k3_moe_dispatch --branch x --seed {seed}", started_at="2026-01-01T00:00:00+00:00",
        duration_s=1.0)


def test_feedback_has_evidence_and_no_seed():
    text = render_feedback(_result(SEED), attempt=1, attempts=3, hidden=[SEED])
    assert text.startswith("# Feedback on attempt 1 of 3: REJECTED")
    assert "- correctness: FAIL: 1 of 29 configurations wrong" in text
    assert "`random-3-k3_t8` (T=41, E=896; case realistic; ran latency_specialized)" in text
    assert "- mismatch [random-3-k3_t8]: [a_fresh] topk_ids differ (seed <redacted>)" in text
    assert str(SEED) not in text
    assert "workbench verify" not in text  # the reproduce command names the seed


def test_redact_whole_tokens_only():
    assert redact("seed 42 and 142 and 42x and 4242", [42]) == "seed <redacted> and 142 and 42x and 4242"


def test_prices():
    assert price_for("claude-sonnet-4-5-20250929") == price_for("claude-sonnet-4-5")
    assert price_for("claude-opus-4-5").input_per_mtok == 5.0
    assert price_for("claude-opus-4-1-20250805").output_per_mtok == 75.0
    assert price_for("claude-opus-4-9") is None and price_for("gpt-x") is None
    assert cost_usd("claude-haiku-4-5", input_tokens=1_000_000, output_tokens=200_000,
                    cache_creation_input_tokens=400_000, cache_read_input_tokens=2_000_000) == pytest.approx(
        1.0 + 1.0 + 0.5 + 0.2)
    assert cost_usd("unknown-model", input_tokens=10, output_tokens=10) is None
