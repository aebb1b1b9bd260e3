"""Candidate worktrees: patch, folder and branch sources; numbering; clean trees; failures roll back."""

from __future__ import annotations

from pathlib import Path

import git as gitpython
import pytest

from tests.conftest import git
from workbench.errors import CandidateError
from workbench.worktree import create_candidate, remove_candidate

GOOD = "tasks/k3_moe_dispatch/fixtures/good/lean-torch-cpu"
PATCH = "tasks/k3_moe_dispatch/fixtures/bad/isolation-edits-test.patch"
KFILE = "k3_model/kernels/moe_dispatch/__init__.py"


def _branches(repo: Path) -> list[str]:
    return [h.name for h in gitpython.Repo(repo).heads]


def test_folder_candidate_is_committed_in_its_own_worktree(fresh_repo, tmp_path):
    # an overlay outside the task's fixtures (an edited copy of the good fixture), judged on HEAD itself
    src = tmp_path / "tuned"
    (src / KFILE).parent.mkdir(parents=True)
    (src / KFILE).write_text((fresh_repo / GOOD / KFILE).read_text() + "\n# tuned\n")
    before = (fresh_repo / KFILE).read_bytes() if (fresh_repo / KFILE).exists() else None
    c = create_candidate(fresh_repo, "k3_moe_dispatch", str(src))
    assert c.kind == "folder" and c.branch == "wb/k3_moe_dispatch/1" and c.set_aside is None
    assert c.worktree == fresh_repo / ".workbench" / "worktrees" / "k3_moe_dispatch-1"
    assert c.base_commit == c.target_base == git(fresh_repo, "rev-parse", "HEAD")
    wt = gitpython.Repo(c.worktree)
    assert wt.head.commit.hexsha == c.candidate_commit
    assert wt.head.commit.parents[0].hexsha == c.base_commit
    assert [d.b_path for d in wt.head.commit.parents[0].diff(wt.head.commit)] == [KFILE]
    assert not wt.is_dirty(untracked_files=True)
    assert (c.worktree / KFILE).read_bytes() == (src / KFILE).read_bytes()
    # the main checkout is untouched
    assert ((fresh_repo / KFILE).read_bytes() if (fresh_repo / KFILE).exists() else None) == before
    assert gitpython.Repo(fresh_repo).active_branch.name == "main"


def test_numbering_increments_and_patch_applies(fresh_repo):
    c1 = create_candidate(fresh_repo, "k3_moe_dispatch", str(fresh_repo / GOOD))
    c2 = create_candidate(fresh_repo, "k3_moe_dispatch", str(fresh_repo / PATCH))
    assert (c1.branch, c2.branch) == ("wb/k3_moe_dispatch/1", "wb/k3_moe_dispatch/2")
    assert c2.kind == "patch"
    assert (c2.worktree / "tests/guards/test_zz_candidate_relaxed.py").is_file()


def test_branch_candidate_uses_merge_base(fresh_repo):
    git(fresh_repo, "checkout", "-qb", "contrib")
    (fresh_repo / KFILE).write_text("SCOPE = None\n")
    git(fresh_repo, "add", "-A")
    git(fresh_repo, "commit", "-qm", "contrib")
    tip = git(fresh_repo, "rev-parse", "HEAD")
    git(fresh_repo, "checkout", "-q", "main")
    base = git(fresh_repo, "rev-parse", "HEAD")
    c = create_candidate(fresh_repo, "k3_moe_dispatch", "contrib")
    assert (c.kind, c.candidate_commit, c.base_commit) == ("branch", tip, base)


@pytest.mark.slow
def test_patch_that_does_not_apply_rolls_back(fresh_repo, tmp_path):
    bad = tmp_path / "bad.patch"
    bad.write_text("diff --git a/nope.py b/nope.py\n--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-a\n+b\n")
    with pytest.raises(CandidateError, match="does not apply to base"):
        create_candidate(fresh_repo, "k3_moe_dispatch", str(bad))
    assert not any(b.startswith("wb/") for b in _branches(fresh_repo))
    assert not (fresh_repo / ".workbench" / "worktrees" / "k3_moe_dispatch-1").exists()


def test_empty_candidate_and_unknown_source_are_errors(fresh_repo, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CandidateError, match="changes nothing"):
        create_candidate(fresh_repo, "k3_moe_dispatch", str(empty))
    with pytest.raises(CandidateError, match="not a patch file, not a folder and not a git branch"):
        create_candidate(fresh_repo, "k3_moe_dispatch", "no/such/thing")
    assert not any(b.startswith("wb/") for b in _branches(fresh_repo))


def test_ignored_leftovers_are_removed_from_the_worktree(fresh_repo, tmp_path):
    overlay = tmp_path / "overlay"
    (overlay / "k3_model/kernels/moe_dispatch").mkdir(parents=True)
    (overlay / KFILE).write_text("x = 1\n")
    # .gitignore ignores __pycache__: a planted .pyc must not survive into the judged tree
    (overlay / "k3_model/__pycache__").mkdir()
    (overlay / "k3_model/__pycache__/dispatch.cpython-311.pyc").write_bytes(b"\0evil")
    c = create_candidate(fresh_repo, "k3_moe_dispatch", str(overlay))
    assert not (c.worktree / "k3_model/__pycache__/dispatch.cpython-311.pyc").exists()


def test_remove_candidate(fresh_repo):
    c = create_candidate(fresh_repo, "k3_moe_dispatch", str(fresh_repo / GOOD))
    remove_candidate(fresh_repo, c.worktree, c.branch)
    assert not c.worktree.exists()
    assert c.branch not in _branches(fresh_repo)


def test_not_a_patch_gets_the_right_advice(fresh_repo, tmp_path):
    junk = tmp_path / "notes.patch"
    junk.write_text("just some text\n")
    with pytest.raises(CandidateError, match="it is not a git patch; make one with `git diff BASE > candidate.patch`"):
        create_candidate(fresh_repo, "k3_moe_dispatch", str(junk))


def test_stale_patch_names_the_failing_file(fresh_repo, tmp_path):
    bad = tmp_path / "stale.patch"
    bad.write_text("diff --git a/README.md b/README.md\n--- a/README.md\n+++ b/README.md\n@@ -1 +1 @@\n-not the first line\n+x\n")
    with pytest.raises(CandidateError) as ei:
        create_candidate(fresh_repo, "k3_moe_dispatch", str(bad))
    msg = str(ei.value)
    assert "README.md" in msg and "regenerate it against" in msg and "'" not in msg.split("(")[1][:2]


def test_resolve_branch_and_clean(fresh_repo):
    from workbench.worktree import clean_worktrees, resolve_branch

    c = create_candidate(fresh_repo, "k3_moe_dispatch", str(fresh_repo / GOOD))
    assert resolve_branch(fresh_repo, c.branch) == c.branch
    with pytest.raises(CandidateError, match="neither locally nor as origin/wb/nope"):
        resolve_branch(fresh_repo, "wb/nope")
    r = clean_worktrees(fresh_repo, delete_branches=True, older_than_days=0)
    assert (r.removed, r.deleted_branches) == (1, 1)
    assert not c.worktree.exists() and c.branch not in _branches(fresh_repo)


def _small_repo(tmp_path: Path) -> tuple[Path, Path]:
    """A one-commit checkout (``tasks/``, ``k3_model/``) and an overlay folder that changes one file."""
    root = tmp_path / "repo"
    for d in ("tasks", "k3_model"):
        (root / d).mkdir(parents=True)
        (root / d / "README.md").write_text(f"{d}\n")
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "base")
    overlay = tmp_path / "overlay"
    (overlay / "k3_model").mkdir(parents=True)
    (overlay / "k3_model/README.md").write_text("changed\n")
    return root, overlay


def test_run_numbers_are_never_reused_after_clean_branches(tmp_path):
    """Issue 17 item 6.7: after `clean --branches` the next run used to be wb/<task>/1 again."""
    import json

    from workbench.worktree import clean_worktrees, create_agent_worktree

    root, overlay = _small_repo(tmp_path)
    assert [create_candidate(root, "t", str(overlay)).branch for _ in range(2)] == ["wb/t/1", "wb/t/2"]
    clean_worktrees(root, delete_branches=True, older_than_days=0)
    assert [b for b in _branches(root) if b.startswith("wb/")] == []
    c = create_candidate(root, "t", str(overlay))
    assert (c.branch, c.worktree.name) == ("wb/t/3", "t-3")
    assert create_agent_worktree(root, "t").branch == "wb/t/4"  # agent runs share the counter
    assert create_candidate(root, "other", str(overlay)).branch == "wb/other/1"  # one counter per task
    assert json.loads((root / ".workbench/run_numbers.json").read_text()) == {"other": 1, "t": 4}


def _age(wt: Path, days: float) -> None:
    """Set the mtime of every file of a worktree and of its git admin folder ``days`` days back."""
    import os
    import time

    admin = Path(git(wt, "rev-parse", "--absolute-git-dir"))
    t = time.time() - days * 86400
    for top in (wt, admin):
        for p in [top, *top.rglob("*")]:
            os.utime(p, (t, t), follow_symlinks=False)


def test_clean_prunes_old_worktrees_keeps_recent_and_queued_and_says_what_it_freed(tmp_path):
    """Issue 17 item 6.8: by default only worktrees unused for 7 days go; one the queue holds stays."""
    from typer.testing import CliRunner

    from workbench.cli import app
    from workbench.review.store import ReviewStore
    from workbench.worktree import _tree_bytes

    root, overlay = _small_repo(tmp_path)
    (overlay / "k3_model/big.bin").write_bytes(b"x" * 300_000)
    old, recent, queued = (create_candidate(root, "t", str(overlay)) for _ in range(3))
    _age(old.worktree, 8)
    _age(queued.worktree, 30)
    ReviewStore(f"sqlite:///{root / '.workbench/queue.db'}").add(
        result_id="r", result_path="/r.json", result_sha256="0" * 64, task_id="t", branch=queued.branch,
        base_commit=queued.base_commit, candidate_commit=queued.candidate_commit, target_branch="main", who="t")
    size = _tree_bytes(old.worktree)
    assert size > 300_000
    out = CliRunner().invoke(app, ["clean", "--repo", str(root)])
    assert out.exit_code == 0, out.output
    from rich.filesize import decimal

    assert out.stdout.strip() == (f"removed 1 worktree(s), freed {decimal(size)}; kept 1 used within 7 day(s) "
                                  "and 1 held by the review queue")
    assert not old.worktree.exists() and recent.worktree.is_dir() and queued.worktree.is_dir()
    out = CliRunner().invoke(app, ["clean", "--older-than-days", "0", "--branches", "--repo", str(root)])
    assert out.exit_code == 0, out.output
    assert out.stdout.strip().startswith("removed 1 worktree(s), freed ")
    assert out.stdout.strip().endswith("; kept 1 held by the review queue; deleted 2 branch(es)")
    assert not recent.worktree.exists() and queued.worktree.is_dir()
    assert [b for b in _branches(root) if b.startswith("wb/")] == [queued.branch]
    out = CliRunner().invoke(app, ["clean", "--older-than-days", "-1", "--repo", str(root)])
    assert out.exit_code == 2 and "--older-than-days -1: expected a number of days >= 0" in out.stderr


def _merge_kernel(repo: Path, src: Path) -> str:
    """Commit ``src``'s overlay (a good fixture) onto ``main`` as if it had been merged; returns HEAD."""
    import shutil

    for f in src.rglob("*"):
        if f.is_file():
            dst = repo / f.relative_to(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "merge the lean kernel", "--allow-empty")  # main may have it merged already
    return git(repo, "rev-parse", "HEAD")


@pytest.mark.slow
def test_fixture_on_a_base_with_the_op_merged_gets_a_fixture_base(fresh_repo):
    head = _merge_kernel(fresh_repo, fresh_repo / GOOD)
    # judged against the merged kernel (fixture_base=False) the same fixture changes nothing
    with pytest.raises(CandidateError, match="changes nothing"):
        create_candidate(fresh_repo, "k3_moe_dispatch", str(fresh_repo / GOOD), fixture_base=False)
    c = create_candidate(fresh_repo, "k3_moe_dispatch", str(fresh_repo / GOOD))  # a fixture: detected
    assert c.target_base == head and c.base_commit != head
    assert c.set_aside and "moe_dispatch kernel merged at " + head[:10] in c.set_aside
    wt = gitpython.Repo(c.worktree)
    fixture_base = wt.commit(c.base_commit)
    assert fixture_base.parents[0].hexsha == head
    removed = sorted(d.a_path for d in fixture_base.parents[0].diff(fixture_base))
    assert KFILE in removed and all(p.startswith("k3_model/kernels/moe_dispatch/") for p in removed)  # only that op's
    assert all(d.deleted_file for d in fixture_base.parents[0].diff(fixture_base))
    assert "README.md" in [b.name for b in (fixture_base.tree / "k3_model/kernels/moe_dispatch").blobs]
    assert wt.commit(c.candidate_commit).parents[0].hexsha == c.base_commit
    assert [d.b_path for d in fixture_base.diff(wt.commit(c.candidate_commit))] == [KFILE]
    assert (c.worktree / KFILE).read_bytes() == (fresh_repo / GOOD / KFILE).read_bytes()
    again = create_candidate(fresh_repo, "k3_moe_dispatch", str(fresh_repo / GOOD))
    assert again.base_commit == c.base_commit  # the same base gives the same fixture base


def test_no_fixture_base_without_a_merged_kernel_or_for_branches(fresh_repo):
    c = create_candidate(fresh_repo, "k3_moe_dispatch", str(fresh_repo / PATCH))
    if (fresh_repo / KFILE).exists():  # main has the kernel merged: a patch fixture gets a fixture base too
        assert c.set_aside and c.base_commit != c.target_base
    else:
        assert c.set_aside is None and c.base_commit == c.target_base == git(fresh_repo, "rev-parse", "HEAD")
    git(fresh_repo, "checkout", "-qb", "contrib")
    (fresh_repo / "k3_model/kernels/moe_dispatch/NOTES.txt").write_text("x\n")
    git(fresh_repo, "add", "-A")
    git(fresh_repo, "commit", "-qm", "contrib")
    git(fresh_repo, "checkout", "-q", "main")
    b = create_candidate(fresh_repo, "k3_moe_dispatch", "contrib", fixture_base=True)
    assert b.set_aside is None and b.base_commit == b.target_base


@pytest.mark.parametrize("when", ["git worktree add", "committing the candidate"])
def test_ctrl_c_during_set_up_leaves_no_branch_or_worktree(fresh_repo, monkeypatch, when):
    """helper-22 (session 21): Ctrl-C 1.4-2.2 s into `workbench run` (git making the worktree) left a branch
    wb/<task>/<n> with no worktree, every time. A KeyboardInterrupt right after git made the branch, or while
    the candidate is committed, must leave neither."""
    import workbench.worktree as wt_mod

    if when == "git worktree add":
        real = gitpython.cmd.Git._call_process

        def interrupted_after_git(self, method, *args, **kwargs):
            out = real(self, method, *args, **kwargs)
            if method == "worktree" and args[:1] == ("add",):
                raise KeyboardInterrupt  # git made the branch and the worktree, then Ctrl-C came
            return out
        monkeypatch.setattr(gitpython.cmd.Git, "_call_process", interrupted_after_git)
    else:
        def interrupted_overlay(*args, **kwargs):
            raise KeyboardInterrupt
        monkeypatch.setattr(wt_mod, "_overlay", interrupted_overlay)
    with pytest.raises(KeyboardInterrupt):
        create_candidate(fresh_repo, "k3_moe_dispatch", str(fresh_repo / GOOD))
    monkeypatch.undo()
    assert not any(b.startswith("wb/") for b in _branches(fresh_repo))
    assert list((fresh_repo / ".workbench" / "worktrees").iterdir()) == []
