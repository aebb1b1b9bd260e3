"""Concurrency and crash safety of the store: 8 processes at once; SIGKILL mid-write. On SQLite and on a real
PostgreSQL server (``WORKBENCH_TEST_POSTGRES_URL``, started by ``.ci/install-services.sh``; without it the
PostgreSQL cases skip, and fail under ``CI=true``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from workbench.results import read_result, write_result
from workbench.review.store import ReviewStore

WORKER = Path(__file__).with_name("review_worker.py")
PROJECT = Path(__file__).resolve().parents[2]
N_PROC, N_OWN, N_SHARED = 8, 10, 6


def spawn(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(PROJECT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, str(WORKER), *args], cwd=PROJECT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def check_consistent(store: ReviewStore) -> list:
    """Integrity check passes; every item's state is its last transition's; one submission per item."""
    with store.engine.connect() as conn:
        if conn.dialect.name == "sqlite":
            assert conn.exec_driver_sql("PRAGMA integrity_check").scalar() == "ok"
            assert conn.exec_driver_sql("PRAGMA foreign_key_check").all() == []
        orphans = conn.exec_driver_sql("SELECT count(*) FROM review_transitions t LEFT JOIN review_items i "
                                       "ON t.item_id = i.id WHERE i.id IS NULL").scalar()
        assert orphans == 0
    items = store.items()
    for it in items:
        assert it.transitions, it.result_id
        assert it.transitions[0].from_state is None and it.transitions[0].to_state == "queued"
        assert sum(t.from_state is None for t in it.transitions) == 1
        assert it.transitions[-1].to_state == it.state
        for a, b in zip(it.transitions, it.transitions[1:]):
            assert b.from_state == a.to_state
    assert len({it.result_id for it in items}) == len(items)
    return items


@pytest.mark.slow
def test_eight_processes_submit_and_review_without_loss_or_duplicates(repo, tmp_path, db):
    base = read_result(repo.accepted)
    rdir = tmp_path / "results"

    def make(rid: str) -> str:
        return str(write_result(base.model_copy(update={"result_id": rid}), rdir))

    shared = [make(f"shared-{j}") for j in range(N_SHARED)]
    own = {k: [make(f"own-{k}-{j}") for j in range(N_OWN)] for k in range(N_PROC)}
    ReviewStore(db).close()  # schema first, so the race is about rows, not DDL
    go = tmp_path / "go"
    procs = [spawn("race", db, str(go), f"w{k}", *own[k], *shared) for k in range(N_PROC)]
    time.sleep(1.0)
    go.write_text("go")
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-2000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))

    store = ReviewStore(db)
    items = check_consistent(store)
    assert len(items) == N_PROC * N_OWN + N_SHARED
    assert sorted(it.result_id for it in items) == sorted(
        [f"shared-{j}" for j in range(N_SHARED)] + [f"own-{k}-{j}" for k in range(N_PROC) for j in range(N_OWN)])
    created = [rid for o in outs for rid in o["created"]]
    assert len(created) == len(set(created)) == len(items)  # each result inserted by exactly one process
    wins = [i for o in outs for i in o["won"]]
    assert sorted(wins) == sorted(it.id for it in items)  # each item rejected by exactly one process
    by_id = {it.id: it for it in items}
    for o in outs:
        for i in o["won"]:
            it = by_id[i]
            assert (it.state, it.reason, it.transitions[-1].who) == ("rejected", f"rejected by {o['name']}", o["name"])
            assert [t.to_state for t in it.transitions] == ["queued", "rejected"]


def test_kill_inside_a_write_transaction_leaves_store_consistent(repo, tmp_path, db):
    store = ReviewStore(db)
    before, _ = store.add(result_id="committed", result_path="/x", result_sha256="1" * 64, task_id="t", branch="b",
                          base_commit="a" * 40, candidate_commit="c" * 40, target_branch="main", who="me")
    ready = tmp_path / "ready"
    p = spawn("hold", db, str(ready))
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert p.poll() is None, p.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL

    items = check_consistent(store)
    assert [it.result_id for it in items] == ["committed"]  # the half-written item is gone
    t0 = time.monotonic()
    after, created = store.add(result_id="after-kill", result_path="/x", result_sha256="2" * 64, task_id="t",
                               branch="b", base_commit="a" * 40, candidate_commit="c" * 40, target_branch="main", who="me")
    assert created and time.monotonic() - t0 < 5.0  # the dead writer's lock did not survive it
    assert [it.result_id for it in check_consistent(store)] == ["committed", "after-kill"]
    assert store.get(before.id).state == "queued"


@pytest.mark.slow
def test_kill_at_random_moments_of_a_busy_writer(repo, tmp_path, db):
    store = ReviewStore(db)
    seen = 0
    for round_, delay_s in enumerate((0.05, 0.13, 0.21)):
        p = spawn("churn", db, f"r{round_}")
        deadline = time.monotonic() + 120  # the worker is busy writing before we start the clock
        while sum(store.counts().values()) < seen + 5:
            assert p.poll() is None, p.stderr.read()
            assert time.monotonic() < deadline, "the churn worker wrote nothing"
            time.sleep(0.02)
        time.sleep(delay_s)
        assert p.poll() is None, p.stderr.read()
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        items = check_consistent(store)
        assert len(items) > seen  # the round committed work and kept all earlier rounds
        seen = len(items)
        mine = sorted(int(it.result_id.split("-")[1]) for it in items if it.result_id.startswith(f"r{round_}-"))
        assert mine == list(range(len(mine)))  # committed in order, no gap, no duplicate
        for it in items:
            if it.result_id.startswith(f"r{round_}-"):
                n = int(it.result_id.split("-")[1])
                if n % 2 == 0:
                    assert it.state == "queued"
                elif n != mine[-1]:  # killed between the add and its reject: queued is fine for the last one
                    assert it.state == "rejected" and it.reason == "churn"
