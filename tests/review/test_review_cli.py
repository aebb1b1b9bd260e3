"""``workbench review ...`` and the run/verify hook that queues accepted candidates."""

from __future__ import annotations

import pytest
from review_helpers import REVIEWER, git
from typer.testing import CliRunner

from workbench.cli import app
from workbench.results import read_result

runner = CliRunner()


def invoke(repo, *args):
    return runner.invoke(app, [*args, "--repo", str(repo.root)], env={"COLUMNS": "250", "WORKBENCH_DB": ""})


@pytest.mark.parametrize("command", ["run", "verify"])
def test_run_and_verify_queue_accepted_results(repo, monkeypatch, command):
    import workbench.pipeline as pipeline

    result = read_result(repo.accepted)
    monkeypatch.setattr(pipeline, "run_candidate", lambda *a, **k: (result, repo.accepted))
    opt = "--candidate" if command == "run" else "--branch"
    source = "x" if command == "run" else result.candidate.candidate_commit  # verify resolves its branch first
    out = runner.invoke(app, [command, "k3_moe_dispatch", opt, source, "--repo", str(repo.root)], env={"WORKBENCH_DB": ""})
    assert out.exit_code == 0, out.output
    assert out.stdout.strip().splitlines()[-1] == str(repo.accepted)  # the last stdout line stays the result path
    assert "review queue: queued as #1" in out.stderr
    listing = invoke(repo, "review", "list")
    assert listing.exit_code == 0
    assert result.candidate.branch in listing.stdout and "queued" in listing.stdout


def test_no_queue_and_rejected_results_are_not_queued(repo, monkeypatch):
    import workbench.pipeline as pipeline

    good, bad = read_result(repo.accepted), read_result(repo.rejected)
    monkeypatch.setattr(pipeline, "run_candidate", lambda *a, **k: (good, repo.accepted))
    out = runner.invoke(app, ["run", "k3_moe_dispatch", "-c", "x", "--no-queue", "--repo", str(repo.root)], env={"WORKBENCH_DB": ""})
    assert out.exit_code == 0 and "review queue" not in out.stderr
    monkeypatch.setattr(pipeline, "run_candidate", lambda *a, **k: (bad, repo.rejected))
    out = runner.invoke(app, ["run", "k3_moe_dispatch", "-c", "x", "--repo", str(repo.root)], env={"WORKBENCH_DB": ""})
    assert out.exit_code == 1 and "review queue" not in out.stderr
    assert "(0)" in invoke(repo, "review", "list").stdout


def test_review_show_approve_reject_cycle(repo):
    assert invoke(repo, "review", "submit", str(repo.accepted)).stdout.strip() == "queued as #1"
    shown = invoke(repo, "review", "show", "1")
    assert shown.exit_code == 0
    result = read_result(repo.accepted)
    for v in result.verdicts:
        assert v.guard in shown.stdout
    assert "merge: clean" in shown.stdout and result.command in shown.stdout
    ok = invoke(repo, "review", "approve", "1")  # default reviewer: git config user.name
    assert ok.exit_code == 0, ok.output
    head = git(repo.root, "rev-parse", "main")
    assert ok.stdout.strip() == f"#1 merged into main as {head}"
    assert git(repo.root, "log", "-1", "--format=%an", "main") == REVIEWER
    again = invoke(repo, "review", "approve", "1")
    assert again.exit_code == 1
    assert again.stderr.strip() == "error: Review item #1 is merged; only queued items can be approved."
    rej = invoke(repo, "review", "reject", "1", "--reason", "late")
    assert rej.exit_code == 1 and "already merged" in rej.stderr
    # submitting a merged result again says where it stands, not "queued" (helper-33, session 27)
    assert invoke(repo, "review", "submit", str(repo.accepted)).stdout.strip() == "already submitted as #1 (merged)"


def test_reject_records_reason_and_reviewer(repo):
    invoke(repo, "review", "submit", str(repo.accepted))
    out = invoke(repo, "review", "reject", "1", "--reason", "no bf16 coverage", "--reviewer", "zoe")
    assert out.exit_code == 0 and out.stdout.strip() == "#1 rejected: no bf16 coverage"
    shown = invoke(repo, "review", "show", "1").stdout
    assert "reason: no bf16 coverage" in shown and "zoe" in shown
    listing = invoke(repo, "review", "list", "--state", "rejected").stdout
    assert "rejected" in listing and "no bf16 coverage" in listing


def test_bad_input_is_one_line(repo):
    out = invoke(repo, "review", "show", "7")
    assert out.exit_code == 2
    assert out.stderr.strip().count("\n") == 0 and "Review item 7 does not exist" in out.stderr
    out = invoke(repo, "review", "list", "--state", "done")
    assert out.exit_code == 2 and "--state 'done': expected one of" in out.stderr
    out = invoke(repo, "review", "submit", str(repo.rejected))
    assert out.exit_code == 2 and "only accepted candidates enter the review queue" in out.stderr
    out = runner.invoke(app, ["review", "list", "--db", "bogus://", "--repo", str(repo.root)])
    assert out.exit_code == 2 and "cannot open it" in out.stderr
