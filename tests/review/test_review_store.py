"""The queue's states, transitions, idempotent submission and refusals (no merges here)."""

from __future__ import annotations

import json

import pytest

from workbench.errors import WorkbenchError
from workbench.results import file_sha256, read_result
from workbench.review import service
from workbench.review.store import ReviewError, ReviewStore, State


def test_submit_queues_accepted_result_with_timestamped_transition(repo):
    store = repo.store()
    item, created = service.submit_result(store, repo.accepted, who="ci-bot")
    result = read_result(repo.accepted)
    assert created is True
    assert item.state == "queued"
    assert item.result_id == result.result_id
    assert item.candidate_commit == result.candidate.candidate_commit
    assert item.base_commit == result.candidate.base_commit
    assert item.branch == result.candidate.branch
    assert item.target_branch == "main"
    assert item.result_sha256 == file_sha256(repo.accepted)
    assert [(t.from_state, t.to_state, t.who) for t in item.transitions] == [(None, "queued", "ci-bot")]
    assert item.transitions[0].at.startswith(item.created_at[:10]) and "T" in item.transitions[0].at
    assert (repo.root / ".workbench" / "queue.db").is_file()


def test_submit_twice_is_one_item(repo):
    store = repo.store()
    a, created_a = service.submit_result(store, repo.accepted)
    b, created_b = service.submit_result(store, repo.accepted)
    assert (created_a, created_b) == (True, False)
    assert a.id == b.id
    assert len(store.items()) == 1
    assert len(store.get(a.id).transitions) == 1


def test_rejected_result_never_enters_the_queue(repo):
    store = repo.store()
    with pytest.raises(ReviewError, match=r"rejected by the guards \(isolation FAIL"):
        service.submit_result(store, repo.rejected)
    assert store.items() == []


def test_resubmitting_a_changed_result_file_is_refused(repo):
    store = repo.store()
    service.submit_result(store, repo.accepted)
    data = json.loads(repo.accepted.read_text())
    data["duration_s"] = data["duration_s"] + 1.0
    repo.accepted.write_text(json.dumps(data))
    with pytest.raises(ReviewError, match="result files are immutable"):
        service.submit_result(store, repo.accepted)


def test_reject_records_reason_who_and_is_final(repo):
    store = repo.store()
    item, _ = service.submit_result(store, repo.accepted)
    out = service.reject(store, item.id, reviewer="bob", reason="scope claims fp32 only; add bf16")
    assert out.state == "rejected"
    assert out.reason == "scope claims fp32 only; add bf16"
    last = out.transitions[-1]
    assert (last.from_state, last.to_state, last.who, last.note) == ("queued", "rejected", "bob", out.reason)
    with pytest.raises(ReviewError, match="already rejected"):
        service.reject(store, item.id, reviewer="bob", reason="again")
    with pytest.raises(ReviewError, match="is rejected .*only queued items can be approved"):
        service.approve(store, repo.root, item.id, reviewer="bob")
    assert len(store.get(item.id).transitions) == 2


def test_reject_needs_a_reason(repo):
    store = repo.store()
    item, _ = service.submit_result(store, repo.accepted)
    with pytest.raises(ReviewError, match="needs a reason"):
        service.reject(store, item.id, reviewer="bob", reason="   ")
    assert store.get(item.id).state == "queued"


def test_transition_is_compare_and_set(repo):
    store = repo.store()
    item, _ = service.submit_result(store, repo.accepted)
    store.transition(item.id, State.QUEUED, State.APPROVED, who="a")
    with pytest.raises(ReviewError, match="is approved, expected queued"):
        store.transition(item.id, State.QUEUED, State.APPROVED, who="b")
    got = store.get(item.id)
    assert [t.to_state for t in got.transitions] == ["queued", "approved"]
    assert got.transitions[-1].who == "a"


@pytest.mark.parametrize("src,dst", [(State.MERGED, State.QUEUED), (State.REJECTED, State.APPROVED),
                                     (State.STALE, State.APPROVED), (State.QUEUED, State.MERGED)])
def test_disallowed_transitions_are_refused(repo, src, dst):
    store = repo.store()
    item, _ = service.submit_result(store, repo.accepted)
    with pytest.raises(ReviewError, match=f"{src.value} -> {dst.value} is not allowed"):
        store.transition(item.id, src, dst, who="x")
    assert store.get(item.id).state == "queued"


def test_unknown_id_and_bad_url_are_one_line_errors(repo, tmp_path):
    store = repo.store()
    with pytest.raises(ReviewError, match="Review item 42 does not exist"):
        store.get(42)
    with pytest.raises(ReviewError) as exc:
        ReviewStore("nosuchdialect://x/y")
    assert "cannot open it" in str(exc.value) and "\n" not in str(exc.value)
    assert isinstance(exc.value, WorkbenchError)


def test_db_url_from_env_and_wal_mode(repo, tmp_path, monkeypatch):
    db = tmp_path / "team.db"
    monkeypatch.setenv("WORKBENCH_DB", f"sqlite:///{db}")
    store = service.open_store(repo.root)
    service.submit_result(store, repo.accepted)
    assert db.is_file()
    assert not (repo.root / ".workbench" / "queue.db").exists()
    with store.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"


def test_verdict_policy(repo):
    from guards.verdict import Evidence, Status, Verdict

    r = read_result(repo.accepted)
    assert service.verdict_refusal(r) is None
    error = r.model_copy(update={"verdicts": r.verdicts[:-1] + (
        Verdict(guard="perf", status=Status.ERROR, summary="timer broke"),)})
    assert service.verdict_refusal(error) == "guard perf is ERROR: timer broke"
    fail = r.model_copy(update={"verdicts": (Verdict(guard="isolation", status=Status.FAIL, summary="edits tests",
                                                     evidence=(Evidence(name="p", value="tests/x"),)),) + r.verdicts[1:]})
    assert service.verdict_refusal(fail) == "guard isolation is FAIL: edits tests"
    skip = r.model_copy(update={"verdicts": r.verdicts[:-1] + (
        Verdict(guard="perf", status=Status.SKIP, summary="no CUDA: perf does not apply"),)})
    assert service.verdict_refusal(skip) is None  # accepted: a SKIP of a guard that did not apply is allowed
    skip_rejected = skip.model_copy(update={"accepted": False})
    assert service.verdict_refusal(skip_rejected).startswith("guard perf was SKIP in a result the guards did not accept")
