"""The Ray pool on a real cluster (``.ci/install-services.sh``: a head and 2 one-CPU worker nodes).

Each verdict is a Ray task; the agent loop with ``--parallel 2`` keeps its feedback; a worker killed
mid-verdict gives an ERROR verdict or, within the retry bound, one re-run, never a lost or second result;
a worker without the device refuses. Cheap candidates: the isolation guard's rejections (a changed test
file), one real correctness rejection, and a guard that sleeps so a worker can be killed inside it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pool_helpers
import pytest
from pool_helpers import SlowGuard

from guards.isolation import IsolationGuard
from workbench.pipeline import judge_candidate
from workbench.results import read_result
from workbench.taskspec import load_task
from workbench.worktree import create_candidate, state_dir

TASK = "k3_moe_dispatch"
FIXTURES = Path(__file__).resolve().parents[2] / "tasks" / TASK / "fixtures"
GOOD = FIXTURES / "good" / "lean-torch-cpu"

AGENT = """\
import os, pathlib
attempt = os.environ["WORKBENCH_ATTEMPT"]
feedback = pathlib.Path(os.environ["WORKBENCH_FEEDBACK"]).read_text() if os.environ["WORKBENCH_FEEDBACK"] else ""
pathlib.Path("tests/attempt.txt").write_text(f"attempt {attempt}\\n" + feedback[:2000])
"""
"""A command agent that edits a test file (the isolation guard rejects it at once) and copies the feedback it
was given into it, so the commit shows what the loop fed back."""


def _cli(repo: Path, *args: str, timeout_s: float = 420) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workbench", *args], cwd=repo, capture_output=True, text=True,
                          timeout=timeout_s)


def _ledger(repo: Path) -> list[dict]:
    from workbench.retries import ledger_path

    p = ledger_path(state_dir(repo))
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def _ray_pool(address: str, **kw):
    import ray

    from workbench.pool.ray_pool import RayPool

    ray.cloudpickle.register_pickle_by_value(pool_helpers)  # the workers cannot import tests/pool/
    return RayPool(address, **kw)


def test_agent_loop_parallel_2_on_the_cluster_keeps_feedback(repo, ray_address, tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    p = _cli(repo, "agent", TASK, "--backend", "command", "--agent-cmd", f"{sys.executable} {agent}", "--attempts", "2",
             "--parallel", "2", "--pool", ray_address, "--device", "cpu", "--no-queue")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]  # every attempt rejected (a test file changed)
    records = [Path(x) for x in re.findall(r"^run record: (.+)$", p.stdout, re.M)]
    assert len(records) == 2
    labels = set()
    for rec in records:
        run = json.loads(rec.read_text())
        assert [a["attempt"] for a in run["attempts"]] == [1, 2]
        for a in run["attempts"]:
            assert a["first_failure"].startswith("isolation: ")
            r = read_result(Path(a["result_path"]))
            assert [v.status.value for v in r.verdicts][:2] == ["FAIL", "SKIP"]
            assert r.candidate.changed_paths == ("tests/attempt.txt",)
            labels.add(r.result_id)
        second = subprocess.run(["git", "-C", str(repo), "show", f"{run['attempts'][1]['commit']}:tests/attempt.txt"],
                                capture_output=True, text=True, check=True).stdout
        assert second.startswith("attempt 2\n") and "isolation" in second  # attempt 2 was fed attempt 1's verdict
    assert len(labels) == 4
    boards = list((state_dir(repo) / "pool").glob("*.json"))
    board = json.loads(max(boards, key=lambda b: b.stat().st_mtime).read_text())
    assert board["pool"] == ray_address and set(board["verdicts"]) == labels
    for entry in board["verdicts"].values():
        assert (entry["state"], entry["tries"], entry["note"]) == ("done", 1, "isolation FAIL")
        assert entry["pid"] != board["pid"] and entry["node"]  # judged by a Ray worker, not the CLI process
    for label in labels:
        assert f"pool: {label} queued" in p.stderr and f"pool: {label} done: isolation FAIL" in p.stderr
        assert re.search(rf"pool: {re.escape(label)} running on \S+ \(pid \d+, try 1\)", p.stderr)


def test_run_on_the_cluster_judges_correctness_in_a_worker(repo, ray_address):
    bad = FIXTURES / "bad" / "correctness-wrong-at-batch-33"
    p = _cli(repo, "run", TASK, "--candidate", str(bad), "--pool", ray_address, "--device", "cpu", "--no-queue")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert re.search(r"correctness\s+FAIL .*k3_t33", p.stdout), p.stdout
    assert re.search(r"isolation\s+PASS", p.stdout) and re.search(r"audit\s+PASS", p.stdout)
    result = read_result(Path(p.stdout.strip().splitlines()[-1]))
    assert any(c.name == "k3_t33" and not c.passed for c in result.cases)  # the worker's cases came back
    assert "running on" in p.stderr


def _judge_in_thread(repo: Path, pool, guards, device: str = "cpu"):
    task = load_task(repo, TASK)
    cand = create_candidate(repo, TASK, str(GOOD))
    out: dict = {}

    def go() -> None:
        out["result"], out["path"] = judge_candidate(repo, task, cand, device=device, seed=11, guards=guards, pool=pool)

    t = threading.Thread(target=go)
    t.start()
    return t, out, cand


def _label(cand) -> str:
    return f"{TASK}-{cand.branch.rsplit('/', 1)[-1]}-{cand.candidate_commit[:8]}"


@pytest.mark.slow
@pytest.mark.parametrize("max_retries", [0, 1])
def test_worker_killed_mid_verdict_gives_error_or_one_rerun_never_two_results(repo, ray_address, tmp_path,
                                                                             max_retries):
    from workbench.pool.ray_pool import wait_for_running

    marker = tmp_path / "slept"
    guard = SlowGuard(str(marker), sleep_s=300)
    guard.name = f"slow_r{max_retries}"  # its own content key: the two cases do not pool with each other
    pool = _ray_pool(ray_address, max_retries=max_retries)
    try:
        t, out, cand = _judge_in_thread(repo, pool, [IsolationGuard(), guard])
        label = _label(cand)
        entry = wait_for_running(pool, label, timeout_s=240)
        while not marker.exists():  # inside the slow guard: mid-verdict
            assert t.is_alive()
            threading.Event().wait(0.05)
        os.kill(entry.pid, signal.SIGKILL)
        t.join(timeout=240)
        assert not t.is_alive()
    finally:
        pool.close()
    result = out["result"]
    results = sorted((state_dir(repo) / "results").glob(f"{label}*.json"))
    assert results == [out["path"]]  # one result file for the verdict
    assert [j["result_id"] for j in _ledger(repo)].count(label) == 1  # one judging recorded
    board = pool.board.entries[label]
    if max_retries == 0:
        first = result.verdicts[0]
        assert (first.guard, first.status.value) == ("pool", "ERROR")
        assert "died mid-verdict" in first.summary and "at most 0" in first.summary and "started 1 time" in first.summary
        assert [v.status.value for v in result.verdicts[1:]] == ["SKIP", "SKIP"] and not result.accepted
        assert (board.state, board.tries) == ("error", 1)
    else:
        assert [(v.guard, v.status.value) for v in result.verdicts] == [("isolation", "PASS"), (guard.name, "PASS")]
        assert (board.state, board.tries) == ("done", 2)  # Ray re-ran it once, on a live worker
        assert board.pid != entry.pid


def test_worker_without_the_device_refuses(repo, ray_address, monkeypatch):
    pool = _ray_pool(ray_address, max_retries=0)
    try:
        # the cluster has no GPU, so the driver refuses a cuda verdict before submitting it ...
        from workbench.pool import PoolError

        with pytest.raises(PoolError, match=r"needs 1 GPUs on one node .* the largest node has 0"):
            pool.options_for(load_task(repo, TASK), "cuda")
        with pytest.raises(ValueError, match="no node of the pool .* has a GPU"):
            pool.detect_device("cuda")
        assert pool.detect_device("auto") == "cpu"
        # ... and a worker that is sent one anyway (a node that claims a GPU torch cannot see) refuses it
        monkeypatch.setattr(pool, "options_for", lambda task, device: {"num_cpus": 1, "num_gpus": 0})
        t, out, cand = _judge_in_thread(repo, pool, [IsolationGuard()], device="cuda")
        t.join(timeout=240)
    finally:
        pool.close()
    first = out["result"].verdicts[0]
    assert (first.guard, first.status.value) == ("pool", "ERROR")
    assert re.fullmatch(r"Pool worker on node \S+ refuses the verdict: it needs 1 CUDA device\(s\) on one node, "
                        r"torch sees 0 here; .*--device cpu\.", first.summary), first.summary
    assert pool.board.entries[_label(cand)].state == "error"
