"""The pool without a cluster: bad input is one line, the local pool's progress board, the resources a
verdict asks Ray for, and a worker's device refusal (faked device counts)."""

from __future__ import annotations

import json
import re
import sys

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from workbench.cli import app
from workbench.pool import Board, PoolError, open_pool, read_boards
from workbench.pool.ray_pool import DeviceRefused, refuse_without_device, resources_for
from workbench.taskspec import load_task
from workbench.worktree import state_dir

TASK = "k3_moe_dispatch"


def _err_line(result) -> str:
    lines = [ln for ln in result.output.splitlines() if ln.strip()]
    assert len(lines) == 1, result.output  # one line, never a traceback
    return lines[0]


@pytest.mark.parametrize("args, message", [
    (["agent", TASK, "--backend", "patch", "--candidate", "x", "--parallel", "0"],
     "error: --parallel 0: expected the number of agent runs at once, at least 1; got less. Use --parallel 1 for one run."),
    (["run", TASK, "--candidate", "x", "--pool", "bogus"],
     "error: --pool 'bogus': expected local or ray://HOST:PORT (the Ray Client address of a cluster's head, port "
     "10001 by default); give one of those."),
    (["verify", TASK, "--branch", "main", "--pool", "ray://127.0.0.1"],
     "error: --pool 'ray://127.0.0.1': expected ray://HOST:PORT (e.g. ray://10.0.0.5:10001); got no port."),
    (["agent", TASK, "--backend", "command", "--agent-cmd", "true", "--pool", "ray://127.0.0.1:1"],
     "error: --pool ray://127.0.0.1:1: nothing answers at 127.0.0.1:1 (Connection refused); start the cluster's "
     "head (`ray start --head`, Ray Client port 10001 by default) or fix the address."),
])
def test_bad_pool_input_is_one_line(repo, args, message, monkeypatch):
    monkeypatch.chdir(repo)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert _err_line(result) == message


def test_workbench_pool_env_is_the_default_of_pool(repo, monkeypatch):
    monkeypatch.chdir(repo)
    monkeypatch.setenv("WORKBENCH_POOL", "nowhere")
    result = CliRunner().invoke(app, ["run", TASK, "--candidate", "x"])
    assert result.exit_code == 2 and _err_line(result).startswith("error: --pool 'nowhere': expected local or ray://")


def test_local_parallel_runs_share_one_verdict_at_a_time_and_show_progress(repo, tmp_path, monkeypatch):
    agent = tmp_path / "agent.py"
    agent.write_text("import pathlib\npathlib.Path('tests/edit.txt').write_text('x')\n")
    monkeypatch.chdir(repo)
    before = {p.name for p in (state_dir(repo) / "pool").glob("*.json")}
    result = CliRunner().invoke(app, ["agent", TASK, "--backend", "command", "--agent-cmd", f"{sys.executable} {agent}",
                                      "--parallel", "2", "--pool", "local", "--device", "cpu", "--no-queue"])
    assert result.exit_code == 1, result.output  # both rejected by isolation
    assert len(re.findall(r"^run record: ", result.output, re.M)) == 2
    new = [p for p in (state_dir(repo) / "pool").glob("*.json") if p.name not in before]
    assert len(new) == 1
    board = json.loads(new[0].read_text())
    assert board["pool"] == "local" and len(board["verdicts"]) == 2
    spans = []
    for label, e in board["verdicts"].items():
        assert (e["state"], e["tries"], e["note"], e["pid"]) == ("done", 1, "isolation FAIL", board["pid"])
        assert f"pool: {label} queued" in result.output and f"pool: {label} done: isolation FAIL" in result.output
        spans.append(label)
    shown = CliRunner().invoke(app, ["pool", "status", "--runs", "1"])
    assert shown.exit_code == 0 and "2 done" in shown.output
    assert all(label in shown.output.replace("\n", "") or label[:20] in shown.output for label in spans)
    from workbench.review.store import ReviewStore
    from workbench.review.web import create_app

    with TestClient(create_app(ReviewStore(f"sqlite:///{tmp_path / 'q.db'}"), repo, reviewer="r")) as c:
        page = c.get("/pool")
    assert page.status_code == 200
    for label in spans:
        assert f"<code>{label}</code>" in page.text
    assert page.text.count('<td class="ok">done</td>') >= 2 and '<a href="/pool">pool</a>' in page.text


def test_board_refuses_an_unknown_state_and_reads_back(tmp_path):
    seen = []
    b = Board("local", on_change=lambda label, e: seen.append((label, e.state)))
    b.update(tmp_path, "v1", "queued")
    b.update(tmp_path, "v1", "queued")  # no change, no callback
    b.update(tmp_path, "v1", "running", node="n", pid=7, tries=1)
    with pytest.raises(ValueError, match="state 'lost': expected one of queued, running, done, error"):
        b.update(tmp_path, "v1", "lost")
    assert seen == [("v1", "queued"), ("v1", "running")]
    (boards,) = read_boards(tmp_path)
    assert boards["verdicts"]["v1"]["node"] == "n" and boards["verdicts"]["v1"]["pid"] == 7


def test_resources_ask_one_gpu_per_rank_on_one_node(repo):
    moe, allreduce = load_task(repo, TASK), load_task(repo, "k3_allreduce_rmsnorm")
    assert resources_for(moe, "cuda") == {"num_cpus": 1, "num_gpus": 1}
    assert resources_for(allreduce, "cuda") == {"num_cpus": 1, "num_gpus": max(allreduce.scope.tp_sizes)} == {
        "num_cpus": 1, "num_gpus": 8}
    assert resources_for(allreduce, "cpu") == {"num_cpus": 1, "num_gpus": 0}  # gloo ranks share the verdict's CPU


def test_a_worker_without_enough_cuda_devices_refuses():
    refuse_without_device("cpu", 8, node="n", cuda_count=lambda: 0)  # CPU verdicts need no device
    refuse_without_device("cuda", 2, node="n", cuda_count=lambda: 2)
    with pytest.raises(DeviceRefused) as exc:
        refuse_without_device("cuda", 4, node="10.0.0.7", cuda_count=lambda: 2)
    assert str(exc.value) == ("Pool worker on node 10.0.0.7 refuses the verdict: it needs 4 CUDA device(s) on one "
                              "node, torch sees 2 here; give the node a CUDA build of torch and its GPUs, or judge "
                              "with --device cpu.")


def test_open_pool_local_is_the_default():
    assert open_pool(None).spec == open_pool("").spec == open_pool(" local ").spec == "local"
    with pytest.raises(PoolError):
        open_pool("ray:/x")


def test_a_pool_worker_judges_by_the_base_commits_task_spec_not_the_candidates(repo, tmp_path):
    """Trust: the worker's checkout is the candidate's tree; a candidate that widens its task's
    allowed_paths in task.toml must still be judged by the base's spec (as a local run reads the
    maintainer's checkout), so the isolation guard fails it."""
    pytest.importorskip("ray")
    import subprocess

    from guards.isolation import IsolationGuard
    from guards.verdict import Status
    from workbench.pool.ray_pool import JudgeRequest, judge_in_worker, make_bundle
    from workbench.worktree import create_candidate

    overlay = tmp_path / "widen"
    spec = overlay / "tasks/k3_moe_dispatch/task.toml"
    spec.parent.mkdir(parents=True)
    text = (repo / "tasks/k3_moe_dispatch/task.toml").read_text()
    assert 'allowed_paths = ["k3_model/kernels/moe_dispatch/**"]' in text
    spec.write_text(text.replace('allowed_paths = ["k3_model/kernels/moe_dispatch/**"]',
                                 'allowed_paths = ["k3_model/kernels/moe_dispatch/**", "tasks/**"]'))
    cand = create_candidate(repo, "k3_moe_dispatch", str(overlay))
    req = JudgeRequest(label="widen", task_id="k3_moe_dispatch", bundle=make_bundle(repo, cand, "widen"),
                       source=cand.source, kind=cand.kind, branch=cand.branch, base_commit=cand.base_commit,
                       candidate_commit=cand.candidate_commit, device="cpu", world_size=1, seed=1,
                       guards=(IsolationGuard(),))
    phase = judge_in_worker(req, None)
    (v,) = phase.verdicts
    assert v.status is Status.FAIL and "tasks/k3_moe_dispatch/task.toml" in v.summary, v.summary
    assert subprocess.run(["git", "-C", str(repo), "status", "--short"], capture_output=True, text=True).stdout == ""


def test_a_ray_client_connect_aborted_by_a_busy_head_is_retried_then_reported(monkeypatch):
    import types

    import workbench.pool.ray_pool as rp

    monkeypatch.setattr(rp, "CONNECT_BACKOFF_S", 0.0)
    calls = []

    def flaky(*args, **kw):
        calls.append(kw["address"])
        if len(calls) < 3:
            raise ConnectionAbortedError("Initialization failure from server:")
        return "ctx"

    assert rp._connect(types.SimpleNamespace(init=flaky), "ray://127.0.0.1:1") == "ctx"
    assert calls == ["ray://127.0.0.1:1"] * 3

    def always_aborted(**kw):
        calls.append(kw["address"])
        raise ConnectionAbortedError("Initialization failure from server:")

    calls.clear()
    with pytest.raises(ConnectionAbortedError):
        rp._connect(types.SimpleNamespace(init=always_aborted), "ray://127.0.0.1:1")
    assert len(calls) == rp.CONNECT_ATTEMPTS  # bounded

    def version_mismatch(**kw):
        calls.append(kw["address"])
        raise RuntimeError("Version mismatch")

    calls.clear()
    with pytest.raises(RuntimeError):
        rp._connect(types.SimpleNamespace(init=version_mismatch), "ray://127.0.0.1:1")
    assert calls == ["ray://127.0.0.1:1"]  # any other error is final at once
