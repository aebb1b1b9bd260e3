"""Git side of the review: staleness, the diff a reviewer reads, and the merge (gitpython).

The merge never touches a working tree until it is known to be clean: ``git merge-tree
--write-tree`` computes the merged tree in the object database only (git >= 2.38), ``git
commit-tree`` writes the merge commit, and then the target branch moves by compare-and-set:
``git update-ref`` when no worktree has it checked out, or ``git merge --ff-only`` inside the
worktree that has it checked out (git refuses, changing nothing, if that would overwrite local
edits). A conflict is found before anything moves, so the repository is left untouched.

Source: git-merge-tree(1) "--write-tree", git-update-ref(1) "<old-value>".
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from pathlib import Path

import git

from workbench.review.store import ReviewError
from workbench.worktree import COMMITTER, git_lock

_MIN_GIT = (2, 38)


@dataclasses.dataclass(frozen=True)
class MergeCheck:
    """Whether a candidate still merges cleanly into its target.

    Attributes:
        target_head: SHA of the target branch now.
        base_moved: the target head is not the candidate's base commit.
        clean: the three-way merge has no conflict.
        tree: the merged tree's SHA when clean.
        conflicts: paths (or git's messages) that conflict.
    """

    target_head: str
    base_moved: bool
    clean: bool
    tree: str | None
    conflicts: tuple[str, ...] = ()

    @property
    def stale(self) -> bool:
        """Stale: the base moved and the merge is not a clean replay."""
        return self.base_moved and not self.clean


def _require_git(repo: git.Repo) -> None:
    version = repo.git.version_info[:2]
    if tuple(version) < _MIN_GIT:
        raise ReviewError(f"git {'.'.join(map(str, version))} at {repo.git.GIT_PYTHON_GIT_EXECUTABLE!r} is too old "
                          f"for the review merge; it needs git >= {'.'.join(map(str, _MIN_GIT))} (merge-tree --write-tree).")


def branch_head(repo: git.Repo, branch: str) -> str:
    """SHA of ``refs/heads/<branch>``.

    Raises:
        ReviewError: no such branch.
    """
    try:
        return repo.git.rev_parse("--verify", "--quiet", f"refs/heads/{branch}^{{commit}}").strip()
    except git.GitCommandError:
        raise ReviewError(f"Target branch {branch!r} does not exist in {repo.working_dir}; "
                          "create it or submit with --target BRANCH.") from None


def check_merge(repo: git.Repo, target_branch: str, base_commit: str, candidate_commit: str) -> MergeCheck:
    """Dry-run the merge of ``candidate_commit`` into ``target_branch`` in the object database only.

    Raises:
        ReviewError: the target branch or the candidate commit is missing, or git is too old.
    """
    _require_git(repo)
    head = branch_head(repo, target_branch)
    try:
        repo.git.cat_file("-e", f"{candidate_commit}^{{commit}}")
    except git.GitCommandError:
        raise ReviewError(f"Candidate commit {candidate_commit[:12]} is not in {repo.working_dir}; "
                          "the branch was deleted or the result file is from another clone.") from None
    status, out, _err = repo.git.merge_tree("--write-tree", "--name-only", "--no-messages", head, candidate_commit,
                                           with_extended_output=True, with_exceptions=False)
    lines = out.splitlines()
    if status == 0:
        return MergeCheck(head, head != base_commit, True, lines[0].strip())
    if status == 1:
        return MergeCheck(head, head != base_commit, False, None, tuple(line for line in lines[1:] if line.strip()))
    raise ReviewError(f"git merge-tree of {candidate_commit[:12]} into {target_branch} failed "
                      f"(exit {status}): {_err.strip()[:300]}")


def candidate_diff(repo: git.Repo, base_commit: str, candidate_commit: str, *, max_bytes: int = 400_000) -> tuple[str, tuple[str, ...]]:
    """``git diff base..candidate`` and the paths it touches.

    Returns:
        ``(diff_text, paths)``; the text is cut at ``max_bytes`` (bytes) with a note.
    """
    text = repo.git.diff("--no-color", "--no-ext-diff", f"{base_commit}..{candidate_commit}")
    paths = tuple(p for p in repo.git.diff("--name-only", "--no-renames", f"{base_commit}..{candidate_commit}").splitlines() if p)
    if len(text) > max_bytes:
        text = text[:max_bytes] + f"\n... diff cut at {max_bytes} bytes ...\n"
    return text, paths


def _checked_out_in(repo: git.Repo, branch: str) -> Path | None:
    """The worktree that has ``branch`` checked out, if any."""
    current: Path | None = None
    for line in repo.git.worktree("list", "--porcelain").splitlines():
        if line.startswith("worktree "):
            current = Path(line[len("worktree "):])
        elif line == f"branch refs/heads/{branch}" and current is not None:
            return current
    return None


def merge_candidate(repo_root: Path, *, target_branch: str, base_commit: str, candidate_commit: str,
                    message: str, author: tuple[str, str]) -> str:
    """Merge ``candidate_commit`` into ``target_branch`` with a ``--no-ff`` merge commit.

    Args:
        repo_root: the repository.
        target_branch: e.g. ``main``; may be checked out in a worktree (then it is fast-forwarded there).
        base_commit, candidate_commit: from the result file.
        message: the full merge commit message.
        author: ``(name, email)`` recorded as the merge's author (the reviewer).

    Returns:
        The merge commit's SHA.

    Raises:
        ReviewError: a conflict (nothing changed), the target moved during the merge (nothing
            changed), or a checked-out target whose local edits the merge would overwrite (nothing changed).
    """
    with git_lock(Path(repo_root)):
        return merge_candidate_locked(repo_root, target_branch=target_branch, base_commit=base_commit,
                                      candidate_commit=candidate_commit, message=message, author=author)


def merge_candidate_locked(repo_root: Path, *, target_branch: str, base_commit: str, candidate_commit: str,
                           message: str, author: tuple[str, str]) -> str:
    """:func:`merge_candidate` for a caller that already holds :func:`workbench.worktree.git_lock`."""
    repo = git.Repo(repo_root)
    if True:
        chk = check_merge(repo, target_branch, base_commit, candidate_commit)
        if not chk.clean:
            raise ReviewError(
                f"Merge of {candidate_commit[:12]} into {target_branch} ({chk.target_head[:12]}) conflicts in "
                f"{', '.join(chk.conflicts[:5]) or 'some paths'}; the repository was left untouched. "
                "Rebase the candidate onto the target and re-verify it.")
        ident = {"GIT_AUTHOR_NAME": author[0], "GIT_AUTHOR_EMAIL": author[1],
                 "GIT_COMMITTER_NAME": COMMITTER[0], "GIT_COMMITTER_EMAIL": COMMITTER[1]}
        with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".msg", delete=False) as f:
            f.write(message)
        try:
            merge_sha = repo.git.commit_tree(chk.tree, "-p", chk.target_head, "-p", candidate_commit,
                                             "-F", f.name, env={**os.environ, **ident}).strip()
        finally:
            os.unlink(f.name)
        wt = _checked_out_in(repo, target_branch)
        if wt is None:
            try:
                repo.git.update_ref("-m", f"workbench review: merge {candidate_commit[:12]}",
                                    f"refs/heads/{target_branch}", merge_sha, chk.target_head)
            except git.GitCommandError as exc:
                raise ReviewError(f"Target branch {target_branch} moved while merging; nothing changed "
                                  f"({exc.stderr.strip()[:200]}). Approve again.") from None
        else:
            wt_repo = git.Repo(wt)
            if wt_repo.head.commit.hexsha != chk.target_head:
                raise ReviewError(f"Target branch {target_branch} moved while merging; nothing changed. Approve again.")
            try:
                wt_repo.git.merge("--ff-only", "--no-stat", "--quiet", merge_sha, env={**os.environ, **ident})
            except git.GitCommandError as exc:
                msg = re.sub(r"\s+", " ", (exc.stderr or str(exc)).strip())[:300]
                raise ReviewError(
                    f"Target branch {target_branch} is checked out in {wt} and git refused to fast-forward it to "
                    f"the merge {merge_sha[:12]} ({msg}); nothing changed. Commit or stash the local edits there "
                    "and approve again.") from None
        return merge_sha
