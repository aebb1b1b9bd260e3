"""The API key never reaches candidate code: not in guard children, not in the command agent (unless
allowlisted), and not in the guard children of a command agent that was given it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from guards.isolation import IsolationGuard
from guards.sandbox import run_child
from workbench.agents.command_backend import CommandBackend
from workbench.agents.runner import run_agent
from workbench.taskspec import load_task
from workbench.worktree import create_agent_worktree

KEY = "sk-ant-api03-THIS-MUST-NOT-LEAK"
SPY_KERNEL = (
    "import json, os\n"
    "raise RuntimeError('SPY-ENV ' + json.dumps(sorted(os.environ)) + ' KEY=' + str(os.environ.get('ANTHROPIC_API_KEY')))\n"
)


@pytest.mark.slow
def test_guard_child_does_not_see_the_key(repo, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    task = load_task(repo, "k3_moe_dispatch")
    awt = create_agent_worktree(repo, "k3_moe_dispatch")
    (awt.worktree / "k3_model/kernels/moe_dispatch/__init__.py").write_text(SPY_KERNEL)
    request = {"mode": "correctness", "target": task.target, "op": task.op, "device": "cpu",
               "decode_backend": "latency_specialized", "cases": []}
    outcome = run_child(awt.worktree, request, timeout_s=120, memory_bytes=task.timeouts.memory_bytes, device="cpu")
    err = str(outcome.response.get("error"))
    assert "SPY-ENV" in err  # the candidate's code ran and reported its environment
    assert "KEY=None" in err and KEY not in err and "ANTHROPIC_API_KEY" not in err


@pytest.mark.slow
def test_command_agent_and_its_guard_children(repo, tmp_path, monkeypatch):
    """Allowlisted on purpose (an agent that calls the API itself): the agent sees the key, its
    `workbench check` output does not show it."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    agent = tmp_path / "spy_agent.py"
    report = tmp_path / "report.json"
    agent.write_text(
        "import json, os, subprocess, sys\n"
        "from pathlib import Path\n"
        f"Path('k3_model/kernels/moe_dispatch/__init__.py').write_text({SPY_KERNEL!r})\n"
        "chk = subprocess.run([sys.executable, '-m', 'workbench', 'check', 'k3_moe_dispatch', '--no-perf', '--base',"
        " os.environ['WORKBENCH_BASE']], capture_output=True, text=True)\n"
        f"Path({str(report)!r}).write_text(json.dumps({{'agent_key': os.environ.get('ANTHROPIC_API_KEY'),"
        " 'check_rc': chk.returncode, 'check_out': chk.stdout + chk.stderr}))\n")
    backend = CommandBackend(f"{sys.executable} {agent}", env_allow=["ANTHROPIC_API_KEY"])
    run_agent(repo, "k3_moe_dispatch", backend, attempts=1, device="cpu", guards=[IsolationGuard()],
              measure_baseline=False)
    got = json.loads(report.read_text())
    assert got["agent_key"] == KEY
    assert got["check_rc"] == 1, got["check_out"]
    # the self-check is the judge's pipeline: its audit refuses the environment read before any child
    # starts (test_guard_child_does_not_see_the_key shows what a child would see: no key)
    assert "audit                  FAIL" in got["check_out"] and "uses os.environ" in got["check_out"]
    assert KEY not in got["check_out"]


@pytest.mark.slow
def test_command_agent_without_allowlist_has_no_key(repo, tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    agent = tmp_path / "env_agent.py"
    out = tmp_path / "env.txt"
    agent.write_text(f"import os\nopen({str(out)!r}, 'w').write(repr(dict(os.environ)))\n")
    run_agent(repo, "k3_moe_dispatch", CommandBackend(f"{sys.executable} {agent}"), attempts=1, device="cpu",
              guards=[IsolationGuard()], measure_baseline=False)
    text = out.read_text()
    assert "WORKBENCH_TASK" in text and KEY not in text and "ANTHROPIC_API_KEY" not in text


@pytest.mark.slow
def test_git_commits_of_attempts_run_no_hooks(repo, tmp_path, monkeypatch):
    """A hook planted in the shared git config never runs with the workbench's environment."""
    monkeypatch.setenv("ANTHROPIC_API_KEY", KEY)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    spy = tmp_path / "hook-ran.txt"
    (hooks / "post-commit").write_text(f"#!/bin/sh\nenv > {spy}\n")
    (hooks / "post-commit").chmod(0o755)
    subprocess.run(["git", "-C", str(repo), "config", "core.hooksPath", str(hooks)], check=True)
    try:
        agent = tmp_path / "touch_agent.py"
        agent.write_text("open('k3_model/kernels/moe_dispatch/__init__.py', 'w').write('X = 1\\n')\n")
        run = run_agent(repo, "k3_moe_dispatch", CommandBackend(f"{sys.executable} {agent}"), attempts=1, device="cpu",
                        guards=[IsolationGuard()], measure_baseline=False)
        assert run.attempts[0].changed
        assert not spy.exists()
    finally:
        subprocess.run(["git", "-C", str(repo), "config", "--unset", "core.hooksPath"], check=True)
