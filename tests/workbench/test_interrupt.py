"""Ctrl-C in the middle of a judgment: every child stops, the half-made worktree and branch go, the
command says what it interrupted and exits 130 (issue 17 item 2)."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import git

GOOD = "tasks/k3_moe_dispatch/fixtures/good/lean-torch-cpu"


def _processes_under(path: Path) -> list[str]:
    """Command lines of live processes that name ``path`` (the run's worktrees)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(path) in cmd and state != "Z":
            out.append(f"{d.name}: {cmd[:160]}")
    return out


def _child_processes_of(pid: int) -> list[str]:
    """Command lines of the live guard children (``_child_main.py``) descending from process ``pid``
    (children import from the judged tree, a clone outside the worktree: guards/judged_tree.py)."""
    parent, cmds = {}, {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                continue
            parent[int(d.name)] = int(fields[1])
            cmds[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue

    def descends(p: int) -> bool:
        for _ in range(64):
            p = parent.get(p, 0)
            if p == pid:
                return True
            if p <= 1:
                return False
        return False

    return [f"{p}: {c[:160]}" for p, c in cmds.items() if "_child_main.py" in c and descends(p)]


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_mid_correctness_stops_children_removes_worktree_and_exits_130(fresh_repo, sig, code):
    """SIGTERM (``timeout``, ``kill``, a CI runner) is cleaned up as Ctrl-C is, exit 143: helper-22 (session 21)
    found it left the guard child running (orphaned), the worktree, the branch and temporary folders."""
    worktrees = fresh_repo / ".workbench" / "worktrees"
    proc = subprocess.Popen(
        [sys.executable, "-m", "workbench", "run", "k3_moe_dispatch", "-c", GOOD, "--device", "cpu", "--no-queue",
         "--seed", "7"], cwd=fresh_repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:  # wait until the correctness child runs
            ready, _, _ = select.select([proc.stderr], [], [], 1.0)
            if ready:
                line = proc.stderr.readline()
                lines.append(line)
                if "correctness]" in line and "configurations" in line:
                    break
            assert proc.poll() is None, f"the run ended before correctness: {lines}"
        else:
            pytest.fail(f"no correctness progress line within 120 s: {lines}")
        running = time.monotonic() + 60  # the request is being built, or the fork server is importing torch
        while not _child_processes_of(proc.pid) and time.monotonic() < running and proc.poll() is None:
            time.sleep(0.1)
        time.sleep(0.5)  # the child is importing the candidate's code or running cases now
        assert _child_processes_of(proc.pid), "no guard child was running when Ctrl-C came"
        os.kill(proc.pid, sig)
        rest = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = "".join(lines) + (rest or "")
    assert proc.returncode == code, stderr[-2000:]
    assert "Interrupted during correctness" in stderr and "removed worktree" in stderr, stderr[-2000:]
    # the child that was running is counted (its session kills it on the way out, before the handler runs)
    assert re.search(r"stopped [1-9]\d* child process group", stderr), stderr[-2000:]
    assert _processes_under(worktrees) == [] and _child_processes_of(proc.pid) == []
    zygote = fresh_repo / "guards" / "_zygote.py"  # the fork server (guards/_zygote.py) ends with its parent
    gone = time.monotonic() + 10
    while _processes_under(zygote) and time.monotonic() < gone:
        time.sleep(0.1)
    assert _processes_under(zygote) == []
    assert list(worktrees.iterdir()) == []  # the run's worktree existed (its child ran there) and is gone
    assert git(fresh_repo, "branch", "--list", "wb/*") == ""
    assert list((fresh_repo / ".workbench" / "results").glob("*.json")) == []  # no half-written verdict
