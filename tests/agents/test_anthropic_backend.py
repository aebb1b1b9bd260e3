"""The anthropic backend through the real SDK against recorded responses (httpx2 mock transport)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workbench.agents.anthropic_backend import AnthropicBackend
from workbench.agents.base import AttemptContext
from workbench.agents.runner import run_agent
from workbench.agents.transcript import read_transcript
from workbench.errors import AgentError
from workbench.results import read_result
from workbench.taskspec import load_task
from workbench.worktree import create_agent_worktree

GOOD_KERNEL = Path(__file__).resolve().parents[2] / "tasks/k3_moe_dispatch/fixtures/good/lean-torch-cpu/k3_model/kernels/moe_dispatch/__init__.py"


def _ctx(repo: Path, tmp_path: Path, name: str) -> AttemptContext:
    task = load_task(repo, "k3_moe_dispatch")
    awt = create_agent_worktree(repo, "k3_moe_dispatch")
    brief = tmp_path / f"{name}.md"
    brief.write_text("BRIEF TEXT for the test")
    return AttemptContext(task=task, repo_root=repo, worktree=awt.worktree, base_commit=awt.base_commit, attempt=1,
                          attempts=1, brief_file=brief, brief_text=brief.read_text(), feedback_file=None,
                          feedback_text=None, prompt_file=brief, transcript_path=tmp_path / f"{name}.jsonl",
                          device="cpu", self_check=lambda: "self-check: PASS (stub)")


def test_tool_use_and_refused_writes(repo, tmp_path, mock_api, load_recorded):
    api = mock_api(load_recorded("tool_use_refused_write"))
    ctx = _ctx(repo, tmp_path, "tools")
    out = AnthropicBackend(client=api.client(), max_turns=10).attempt(ctx)

    assert (out.stop_reason, out.submitted) == ("submitted", True)
    assert out.note.startswith("Only notes")
    assert len(api.requests) == 6
    first = api.requests[0]
    assert first["model"] == "claude-sonnet-4-6"
    assert [t["name"] for t in first["tools"]] == ["list_files", "read_file", "write_file", "run_check", "submit"]
    # the brief is the cached system block
    assert first["system"][1] == {"type": "text", "text": "BRIEF TEXT for the test", "cache_control": {"type": "ephemeral"}}
    # list_files answered with the kernel folder's README
    listed = api.requests[1]["messages"][-1]["content"][0]
    assert listed["tool_use_id"] == "toolu_01" and listed["is_error"] is False
    assert "k3_model/kernels/moe_dispatch/README.md" in listed["content"]
    # read_file returned the README's text
    readme = (ctx.worktree / "k3_model/kernels/moe_dispatch/README.md").read_text()
    assert api.requests[2]["messages"][-1]["content"][0]["content"] == readme
    # both escapes refused, nothing written there
    refused = api.requests[3]["messages"][-1]["content"][0]
    assert refused["is_error"] is True and "outside allowed_paths" in refused["content"]
    dotdot = api.requests[4]["messages"][-1]["content"][0]
    assert dotdot["is_error"] is True and "'..'" in dotdot["content"]
    assert "# hacked" not in (ctx.worktree / "k3_model/ops/moe_dispatch.py").read_text()
    assert not (repo / "tests/test_x.py").exists() and not (ctx.worktree / "tests/test_x.py").exists()
    # the allowed write happened
    assert (ctx.worktree / "k3_model/kernels/moe_dispatch/notes.py").read_text() == "NOTE = 'allowed'\n"
    # only the last message carries the moving cache breakpoint
    marks = [b for m in api.requests[5]["messages"] for b in m["content"] if "cache_control" in b]
    assert len(marks) == 1 and "cache_control" in api.requests[5]["messages"][-1]["content"][-1]
    # tokens and cost (claude-sonnet-4-6: $3 in, $15 out, $3.75 cache write, $0.30 cache read per MTok)
    u = out.usage
    assert (u.input_tokens, u.output_tokens, u.cache_creation_input_tokens, u.cache_read_input_tokens, u.api_calls) == \
        (310, 480, 3100, 15500, 6)
    assert u.cost_usd == pytest.approx((310 * 3 + 480 * 15 + 3100 * 3.75 + 15500 * 0.30) / 1e6)
    events = read_transcript(ctx.transcript_path)
    assert [e["event"] for e in events][:3] == ["start", "user", "response"]
    tools = [e for e in events if e["event"] == "tool"]
    assert [(t["name"], t["is_error"]) for t in tools] == [
        ("list_files", False), ("read_file", False), ("write_file", True), ("write_file", True),
        ("write_file", False), ("submit", False)]
    assert events[-1]["event"] == "end" and events[-1]["stop_reason"] == "submitted"
    assert "sk-ant-test-not-a-key" not in ctx.transcript_path.read_text()


def test_rate_limit_is_retried_by_the_sdk(repo, tmp_path, mock_api, load_recorded):
    api = mock_api(load_recorded("rate_limit_then_ok"))
    slept = []
    out = AnthropicBackend(client=api.client(max_retries=2), sleep=slept.append).attempt(_ctx(repo, tmp_path, "rl"))
    assert len(api.requests) == 2  # 429, then the same request again
    assert api.requests[0] == api.requests[1]
    assert (out.stop_reason, out.submitted, out.usage.api_calls) == ("end_turn", False, 1)
    assert slept == []  # the SDK's retry sufficed


def test_overload_retried_by_the_backend(repo, tmp_path, mock_api, load_recorded):
    api = mock_api(load_recorded("overloaded_then_ok"))
    slept = []
    ctx = _ctx(repo, tmp_path, "ol")
    out = AnthropicBackend(client=api.client(max_retries=0), sleep=slept.append, backoff_s=2.0).attempt(ctx)
    assert len(api.requests) == 2
    assert len(slept) == 1 and 1.5 <= slept[0] <= 2.5  # 2 s x jitter in [0.75, 1.25]
    retry = [e for e in read_transcript(ctx.transcript_path) if e["event"] == "retry"]
    assert retry[0]["status"] == 529 and retry[0]["error"] == "OverloadedError"
    assert (out.stop_reason, out.submitted) == ("submitted", True)


def test_overload_gives_up_after_its_retries(repo, tmp_path, mock_api):
    busy = {"status": 529, "headers": {"x-should-retry": "false"},
            "body": {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}}
    api = mock_api([busy] * 3)
    slept = []
    with pytest.raises(AgentError, match="kept failing"):
        AnthropicBackend(client=api.client(max_retries=0), overload_retries=2, sleep=slept.append,
                         backoff_s=1.0).attempt(_ctx(repo, tmp_path, "ol2"))
    assert len(api.requests) == 3 and len(slept) == 2 and slept[1] > slept[0] * 0.9


def test_max_turns_exhaustion(repo, tmp_path, mock_api, load_recorded):
    api = mock_api(load_recorded("endless_listing"))
    out = AnthropicBackend(client=api.client(), max_turns=3).attempt(_ctx(repo, tmp_path, "mt"))
    assert (out.stop_reason, out.submitted, out.usage.api_calls) == ("max_turns", False, 3)
    assert len(api.requests) == 3


def test_wall_clock_budget_exhaustion(repo, tmp_path, mock_api, load_recorded):
    api = mock_api(load_recorded("endless_listing"))
    out = AnthropicBackend(client=api.client(), budget_s=1e-9).attempt(_ctx(repo, tmp_path, "bud"))
    assert (out.stop_reason, out.usage.api_calls) == ("budget", 0)
    assert api.requests == []


@pytest.mark.slow
def test_authentication_error_is_an_agent_error(repo, tmp_path, mock_api, load_recorded):
    api = mock_api(load_recorded("auth_error"))
    with pytest.raises(AgentError, match=r"401.*Check ANTHROPIC_API_KEY"):
        AnthropicBackend(client=api.client()).attempt(_ctx(repo, tmp_path, "auth"))


def test_missing_key_and_bad_limits(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(AgentError, match="ANTHROPIC_API_KEY"):
        AnthropicBackend()
    with pytest.raises(ValueError, match="--max-turns 0"):
        AnthropicBackend(client=object(), max_turns=0)
    with pytest.raises(ValueError, match="--budget-s"):
        AnthropicBackend(client=object(), budget_s=0)


@pytest.mark.slow
def test_full_attempt_writes_good_kernel_and_guards_accept(repo, mock_api, load_recorded):
    """The recorded conversation writes the good fixture's kernel and submits; the guards accept it.

    Perf is left out of this run: on a shared 2-core CPU its interleaved timing can call a real gain
    noise, and the perf guard has its own tests; isolation, correctness and activation decide here.
    """
    from guards.activation import ActivationGuard
    from guards.correctness import CorrectnessGuard
    from guards.isolation import IsolationGuard

    api = mock_api(load_recorded("full_attempt_good_kernel", GOOD_KERNEL=GOOD_KERNEL.read_text()))
    backend = AnthropicBackend(client=api.client())
    run = run_agent(repo, "k3_moe_dispatch", backend, attempts=2, device="cpu", measure_baseline=False,
                    seeds=[987654321, 987654322], guards=[IsolationGuard(), CorrectnessGuard(), ActivationGuard()])

    assert run.accepted and len(run.attempts) == 1
    rec = run.attempts[0]
    assert rec.changed and rec.outcome["stop_reason"] == "submitted"
    result = read_result(Path(rec.result_path))
    assert result.accepted
    assert [(v.guard, v.status.value) for v in result.verdicts] == [
        ("isolation", "PASS"), ("correctness", "PASS"), ("activation", "PASS")]
    assert result.candidate.agent == "anthropic:claude-sonnet-4-6 attempt 1/2"
    assert result.candidate.transcript_path == rec.transcript_path
    assert result.candidate.changed_paths == ("k3_model/kernels/moe_dispatch/__init__.py",)
    assert Path(rec.result_path).name.startswith(f"k3_moe_dispatch-{run.branch.rsplit('/', 1)[1]}-a1-")
    # the committed kernel is the fixture's, byte for byte
    import subprocess
    shown = subprocess.run(["git", "-C", str(repo), "show", f"{rec.commit}:k3_model/kernels/moe_dispatch/__init__.py"],
                           capture_output=True, text=True, check=True).stdout
    assert shown == GOOD_KERNEL.read_text()
    # the brief went out in tools mode and never names the run-time seed
    system = api.requests[0]["system"][1]["text"]
    assert "run_check" in system and "987654321" not in system
    record = json.loads(run.record_path.read_text())
    assert record["status"] == "accepted" and record["usage"]["api_calls"] == 2
    assert record["usage"]["cost_usd"] == pytest.approx((110 * 3 + 1540 * 15 + 3200 * 3.75 + 3200 * 0.30) / 1e6)
