"""The runner: concurrent runs in separate worktrees, the patch backend, the self-check CLI, CLI errors."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from guards.isolation import IsolationGuard
from workbench.agents.command_backend import CommandBackend
from workbench.agents.patch_backend import PatchBackend
from workbench.agents.runner import run_agent
from workbench.cli import app
from workbench.results import read_result

FIXTURES = Path(__file__).resolve().parents[2] / "tasks/k3_moe_dispatch/fixtures"


@pytest.mark.slow
def test_concurrent_runs_do_not_share_git_state(repo, tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text("import os\nopen('k3_model/kernels/moe_dispatch/__init__.py', 'w').write("
                     "'TAG = %r\\n' % os.environ['WORKBENCH_ATTEMPT'] + '# ' + os.getcwd() + '\\n')\n")
    runs, errors = [], []

    def one() -> None:
        try:
            runs.append(run_agent(repo, "k3_moe_dispatch", CommandBackend(f"{sys.executable} {agent}"), attempts=2,
                                  device="cpu", guards=[IsolationGuard()], measure_baseline=False))
        except Exception as exc:  # reported below with the thread's error
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert errors == [] and len(runs) == 4
    assert len({r.branch for r in runs}) == 4 and len({r.worktree for r in runs}) == 4
    for r in runs:
        assert len(r.attempts) == 2  # isolation alone never accepts (no activation proof), so both ran
        a1, a2 = r.attempts
        log = subprocess.run(["git", "-C", str(repo), "log", "--format=%H %P", "-2", r.branch], capture_output=True,
                             text=True, check=True).stdout.split()
        assert log == [a2.commit, a1.commit, a1.commit, r.base_commit]  # attempt 2 on attempt 1 on the base
        body = subprocess.run(["git", "-C", str(repo), "show", f"{a2.commit}:k3_model/kernels/moe_dispatch/__init__.py"],
                              capture_output=True, text=True, check=True).stdout
        assert body == f"TAG = '2'\n# {r.worktree}\n"  # each run's commit holds its own worktree's file
        assert {Path(a.result_path).name for a in r.attempts} == {
            Path(a.result_path).name for a in r.attempts if r.worktree.name.split("-")[-1] in Path(a.result_path).name}
    assert len({a.result_path for r in runs for a in r.attempts}) == 8
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True).stdout
    assert status == ""  # the main checkout was never touched


@pytest.mark.slow
def test_patch_backend_replays_once(repo):
    run = run_agent(repo, "k3_moe_dispatch", PatchBackend(str(FIXTURES / "bad/isolation-edits-test.patch"), repo),
                    attempts=3, device="cpu", guards=[IsolationGuard()], measure_baseline=False)
    assert len(run.attempts) == 1  # it cannot revise, so no second attempt
    result = read_result(Path(run.attempts[0].result_path))
    assert result.first_failure().guard == "isolation"
    assert any(p.startswith("tests/") for p in result.candidate.changed_paths)
    folder = run_agent(repo, "k3_moe_dispatch", PatchBackend(str(FIXTURES / "good/lean-torch-cpu"), repo), attempts=1,
                       device="cpu", guards=[IsolationGuard()], measure_baseline=False)
    r = read_result(Path(folder.attempts[0].result_path))
    assert r.verdicts[0].status.value == "PASS"
    assert r.candidate.changed_paths == ("k3_model/kernels/moe_dispatch/__init__.py",)


@pytest.mark.slow
def test_check_command_in_a_worktree(repo):
    from workbench.worktree import create_agent_worktree

    awt = create_agent_worktree(repo, "k3_moe_dispatch")
    kernel = awt.worktree / "k3_model/kernels/moe_dispatch/__init__.py"
    kernel.write_text((FIXTURES / "bad/correctness-wrong-at-batch-33/k3_model/kernels/moe_dispatch/__init__.py").read_text())
    cmd = [sys.executable, "-m", "workbench", "check", "k3_moe_dispatch", "--base", awt.base_commit, "--no-perf"]
    proc = subprocess.run(cmd, cwd=awt.worktree, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "isolation              PASS" in proc.stdout
    assert "correctness[seed=0]    FAIL" in proc.stdout and "k3_t33" in proc.stdout
    assert "random" not in proc.stdout.split("evidence of")[0].split("correctness[seed=0]")[1].split("k3_t33")[0]
    (awt.worktree / "k3_model/ops/extra.py").write_text("X = 1\n")
    proc = subprocess.run(cmd, cwd=awt.worktree, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "isolation              FAIL" in proc.stdout and "k3_model/ops/extra.py" in proc.stdout


def _git(wt: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(wt), *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.slow
def test_check_judges_a_new_untracked_kernel_file_and_touches_no_git_state(repo):
    """Issue 20 item 1: the self-check is the judge's pipeline on the files as they are. A new, untracked
    kernel file PASSes every guard (activation included: it is the changed source that ran), then staged
    and then committed alike; the agent's index, branch and files are left as they were."""
    from workbench.worktree import create_agent_worktree

    awt = create_agent_worktree(repo, "k3_moe_dispatch")
    kernel = awt.worktree / "k3_model/kernels/moe_dispatch/__init__.py"
    kernel.write_text((FIXTURES / "good/lean-torch-cpu/k3_model/kernels/moe_dispatch/__init__.py").read_text())
    cmd = [sys.executable, "-m", "workbench", "check", "k3_moe_dispatch", "--base", awt.base_commit]
    before = (_git(awt.worktree, "status", "--porcelain"), _git(awt.worktree, "rev-parse", "HEAD"))
    assert before[0].startswith("?? k3_model/kernels/moe_dispatch/"), before
    proc = subprocess.run(cmd, cwd=awt.worktree, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for guard in ("isolation", "audit", "correctness[seed=0]", "activation"):
        assert f"  {guard:<22} PASS" in proc.stdout, proc.stdout
    assert "  perf_estimate          " in proc.stdout and "(estimate, 10 calls per side)" in proc.stdout
    assert "[4/5 activation]" not in proc.stdout  # progress goes to stderr, the report to stdout
    assert (_git(awt.worktree, "status", "--porcelain"), _git(awt.worktree, "rev-parse", "HEAD")) == before
    _git(awt.worktree, "add", "-A")
    proc = subprocess.run([*cmd, "--no-perf"], cwd=awt.worktree, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "  activation             PASS" in proc.stdout, proc.stdout + proc.stderr
    _git(awt.worktree, "-c", "user.name=a", "-c", "user.email=a@b", "commit", "-qm", "kernel")
    proc = subprocess.run([*cmd, "--no-perf"], cwd=awt.worktree, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "  activation             PASS" in proc.stdout, proc.stdout + proc.stderr
    assert _git(awt.worktree, "status", "--porcelain") == ""


@pytest.mark.slow
def test_check_on_an_unchanged_worktree_says_nothing_changed(repo):
    from workbench.worktree import create_agent_worktree

    awt = create_agent_worktree(repo, "k3_moe_dispatch")
    cmd = [sys.executable, "-m", "workbench", "check", "k3_moe_dispatch", "--base", awt.base_commit]
    proc = subprocess.run(cmd, cwd=awt.worktree, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Nothing changed relative to the base commit yet." in proc.stdout, proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--backend", "bogus"], "--backend 'bogus': expected anthropic, command, patch"),
    (["--backend", "command"], "--backend command needs --agent-cmd"),
    (["--backend", "command", "--agent-cmd", "x {nope}"], "unknown placeholder {nope}"),
    (["--backend", "command", "--agent-cmd", "x", "--model", "m"], "--model, --max-turns and --max-tokens belong"),
    (["--backend", "anthropic", "--attempts", "0"], "--attempts 0: must be at least 1"),
    (["--backend", "patch", "--candidate", "x", "--attempts", "2"], "the patch backend judges one fixed candidate"),
    (["--backend", "patch"], "--backend patch needs --candidate"),
    (["--backend", "command", "--agent-cmd", "x", "--candidate", "p.patch"], "--candidate belongs to --backend patch"),
    (["--backend", "anthropic", "--seed", "5"], "--seed is not used by `workbench agent`"),
    (["--backend", "anthropic"], "needs an API key"),
])
def test_agent_cli_bad_input_exits_2(repo, monkeypatch, args, message):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    res = CliRunner().invoke(app, ["agent", "k3_moe_dispatch", "--repo", str(repo), *args])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split())


@pytest.mark.parametrize("args, message", [
    ([], "give --candidate PATCH|FOLDER|BRANCH; to let an agent write one, use `workbench agent k3_moe_dispatch"),
    (["--agent", "command"], "letting an agent write one is its own command: workbench agent k3_moe_dispatch "
                             "--backend command"),
])
def test_cli_bad_input_exits_2(repo, monkeypatch, args, message):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    res = CliRunner().invoke(app, ["run", "k3_moe_dispatch", "--repo", str(repo), *args])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split())
