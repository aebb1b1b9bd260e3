"""Approve merges into the target with the evidence; refusals leave the repository untouched."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from review_helpers import git

from workbench.results import file_sha256, read_result, write_result
from workbench.review import service
from workbench.review.gitops import merge_candidate
from workbench.review.store import ReviewError

CAND_FILE = "k3_model/kernels/moe_dispatch/__init__.py"


def repo_state(root: Path) -> dict:
    """Everything a half-done merge could change: refs, HEAD, index bytes, status, merge markers."""
    gitdir = root / ".git"
    return {
        "refs": git(root, "for-each-ref", "--format=%(refname) %(objectname)"),
        "head": git(root, "rev-parse", "HEAD"),
        "symbolic": git(root, "symbolic-ref", "HEAD"),
        "index": hashlib.sha256(git(root, "ls-files", "--stage").encode()).hexdigest(),  # entries, not stat cache
        "staged": git(root, "diff", "--cached", "--name-status"),
        "status": git(root, "status", "--porcelain", "--untracked-files=all"),
        "merge_head": (gitdir / "MERGE_HEAD").exists(),
    }


def commit_on_main(root: Path, path: str, text: str, msg: str) -> str:
    p = root / path
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    git(root, "add", path)
    git(root, "commit", "-q", "-m", msg)
    return git(root, "rev-parse", "HEAD")


def test_approve_merges_checked_out_main_with_evidence_and_keeps_local_edits(repo):
    store = repo.store()
    result = read_result(repo.accepted)
    item, _ = service.submit_result(store, repo.accepted)
    (repo.root / "README.md").write_text((repo.root / "README.md").read_text() + "\nlocal edit\n")
    before = git(repo.root, "rev-parse", "main")
    assert before == result.candidate.base_commit

    out = service.approve(store, repo.root, item.id, reviewer="alice")

    head = git(repo.root, "rev-parse", "main")
    assert out.state == "merged" and out.merge_commit == head
    assert git(repo.root, "rev-parse", "HEAD") == head  # the checked-out branch moved with its worktree
    assert git(repo.root, "rev-list", "--parents", "-n1", head).split()[1:] == [before, result.candidate.candidate_commit]
    msg = git(repo.root, "log", "-1", "--format=%B", head)
    for v in result.verdicts:
        assert v.one_line() in msg
    assert f"Result-sha256: {file_sha256(repo.accepted)}" in msg
    assert f"Candidate-commit: {result.candidate.candidate_commit}" in msg
    assert "Approved by alice" in msg
    assert git(repo.root, "log", "-1", "--format=%an", head) == "alice"
    # the working tree has the candidate's file, the unrelated local edit survived, nothing staged
    assert git(repo.root, "diff", "HEAD", "--stat", "--", CAND_FILE) == ""
    assert (repo.root / CAND_FILE).is_file()
    assert git(repo.root, "status", "--porcelain") == "M README.md"
    assert [t.to_state for t in out.transitions] == ["queued", "approved", "merged"]
    assert {t.who for t in out.transitions[1:]} == {"alice"}


def test_target_moved_but_clean_still_merges(repo):
    store = repo.store()
    item, _ = service.submit_result(store, repo.accepted)
    moved = commit_on_main(repo.root, "docs/NOTE.md", "unrelated\n", "docs")
    out = service.approve(store, repo.root, item.id, reviewer="alice")
    assert out.state == "merged"
    parents = git(repo.root, "rev-list", "--parents", "-n1", "main").split()[1:]
    assert parents[0] == moved
    assert (repo.root / "docs/NOTE.md").read_text() == "unrelated\n"
    assert git(repo.root, "status", "--porcelain") == ""


def test_stale_candidate_is_refused_and_repo_untouched(repo):
    store = repo.store()
    item, _ = service.submit_result(store, repo.accepted)
    commit_on_main(repo.root, CAND_FILE, "SCOPE = None  # someone else's kernel\n", "conflicting kernel")
    before = repo_state(repo.root)
    with pytest.raises(ReviewError, match=r"stale and was not merged: base moved: main is at .* no longer merges cleanly"):
        service.approve(store, repo.root, item.id, reviewer="alice")
    assert repo_state(repo.root) == before
    got = store.get(item.id)
    assert got.state == "stale" and "re-verify" in got.reason
    assert [t.to_state for t in got.transitions] == ["queued", "stale"]
    with pytest.raises(ReviewError, match="is stale"):
        service.approve(store, repo.root, item.id, reviewer="alice")
    assert service.reject(store, item.id, reviewer="alice", reason="superseded").state == "rejected"


def test_conflicting_merge_leaves_repo_untouched(repo):
    result = read_result(repo.accepted)
    commit_on_main(repo.root, CAND_FILE, "x = 1\n", "conflict")
    before = repo_state(repo.root)
    with pytest.raises(ReviewError, match="conflicts in .*moe_dispatch/__init__.py; the repository was left untouched"):
        merge_candidate(repo.root, target_branch="main", base_commit=result.candidate.base_commit,
                        candidate_commit=result.candidate.candidate_commit, message="m", author=("a", "a@x"))
    assert repo_state(repo.root) == before


def test_target_not_checked_out_is_updated_by_ref(repo):
    store = repo.store()
    result = read_result(repo.accepted)
    git(repo.root, "branch", "release", result.candidate.base_commit)
    item, _ = service.submit_result(store, repo.accepted, target_branch="release")
    main_before = git(repo.root, "rev-parse", "main")
    out = service.approve(store, repo.root, item.id, reviewer="alice")
    assert git(repo.root, "rev-parse", "release") == out.merge_commit
    assert git(repo.root, "rev-parse", "main") == main_before
    assert git(repo.root, "status", "--porcelain") == ""


def test_checked_out_target_with_blocking_local_file_changes_nothing_then_retry(repo):
    store = repo.store()
    item, _ = service.submit_result(store, repo.accepted)
    blocker = repo.root / CAND_FILE
    blocker.write_text("# my uncommitted experiment\n")
    before = repo_state(repo.root)
    with pytest.raises(ReviewError, match="checked out in .* refused to fast-forward .* nothing changed"):
        service.approve(store, repo.root, item.id, reviewer="alice")
    assert repo_state(repo.root) == before
    assert blocker.read_text() == "# my uncommitted experiment\n"
    assert store.get(item.id).state == "approved"  # the decision stands; the merge can be retried
    blocker.unlink()
    out = service.approve(store, repo.root, item.id, reviewer="alice")
    assert out.state == "merged"
    assert [t.to_state for t in out.transitions] == ["queued", "approved", "merged"]


def test_changed_result_file_is_refused(repo):
    store = repo.store()
    item, _ = service.submit_result(store, repo.accepted)
    data = json.loads(repo.accepted.read_text())
    data["perf"][0]["speedup"] = 9.9
    repo.accepted.write_text(json.dumps(data, indent=2))
    before = repo_state(repo.root)
    with pytest.raises(ReviewError, match="changed since submission"):
        service.approve(store, repo.root, item.id, reviewer="alice")
    assert repo_state(repo.root) == before
    assert store.get(item.id).state == "queued"


def test_verdict_not_pass_is_refused(repo):
    from guards.verdict import Status, Verdict

    store = repo.store()
    r = read_result(repo.accepted)
    broken = r.model_copy(update={"result_id": r.result_id + "-err", "verdicts": r.verdicts[:-1] + (
        Verdict(guard="perf", status=Status.ERROR, summary="the timer broke"),)})
    path = write_result(broken, repo.accepted.parent)
    item, _ = service.submit_result(store, path)  # accepted=True in the file, but a verdict is ERROR
    before = repo_state(repo.root)
    with pytest.raises(ReviewError, match="cannot be approved: guard perf is ERROR: the timer broke"):
        service.approve(store, repo.root, item.id, reviewer="alice")
    assert repo_state(repo.root) == before
    assert store.get(item.id).state == "queued"
