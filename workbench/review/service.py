"""Review operations on top of the store: submit accepted results, approve (merge), reject, staleness.

Policy (issue 5): only results the guards accepted enter the queue; approval re-reads the result
file and refuses when its hash changed since submission, when any verdict is FAIL or ERROR, when a
verdict is SKIP and the result is not accepted, or when the candidate is stale. Approval then merges
the judged commit (by SHA, not the branch name, so a branch moved after judgement changes nothing)
and records ``merged``.

What was not judged (issue 15 item 4): an accepted result whose verdicts include a SKIP (perf on a
device where the task is not timed, model_eval for an op K3-mini never calls, ...) is queued as
"accepted, not judged: <guards>" (:func:`judgement_label`); ``review list``/``show`` and the web UI
say so, and approval needs a reviewer's reason for merging it unjudged (``accept_unjudged``, the
CLI's ``--accept-unjudged "REASON"``), which goes into the approval's history note and the merge
commit (:func:`merge_message`). Without one the approval is refused and nothing changes.
"""

from __future__ import annotations

import getpass
import os
from pathlib import Path

import git

from guards.verdict import Status, Verdict
from workbench import envs
from workbench.errors import WorkbenchError
from workbench.results import RunResult, file_sha256, read_result
from workbench.review import gitops
from workbench.review.store import ReviewError, ReviewInputError, ReviewItem, ReviewStore, State, default_db_url
from workbench.worktree import git_lock, state_dir

DEFAULT_TARGET = "main"


def open_store(repo_root: Path, db: str | None = None, *, create: bool = True) -> ReviewStore:
    """The store at ``db`` (a SQLAlchemy URL), else ``$WORKBENCH_DB``, else ``.workbench/queue.db``.

    The default ``.workbench/queue.db`` is made on first use. A URL that is given (``db`` or
    ``$WORKBENCH_DB``) naming a SQLite file needs its folder to exist, and with ``create`` False (commands
    that only read or change existing items) the file too: a mistyped path is an error, not a new empty queue.

    Raises:
        ReviewInputError: the URL cannot be opened, its SQLite folder does not exist, or (``create``
            False) its SQLite file does not exist.
    """
    if db or envs.DB.read().strip():
        return ReviewStore(db or default_db_url(repo_root), create=create)
    state_dir(Path(repo_root)).mkdir(parents=True, exist_ok=True)
    return ReviewStore(default_db_url(repo_root), create=True)


def default_reviewer(repo_root: Path | None = None) -> str:
    """``git config user.name`` of the repository, else the login name."""
    try:
        name = git.Repo(repo_root or Path.cwd(), search_parent_directories=True).config_reader().get_value(
            "user", "name", default="")
    except (git.InvalidGitRepositoryError, git.NoSuchPathError, OSError):
        name = ""
    return str(name).strip() or os.environ.get("USER") or getpass.getuser()


def reviewer_email(repo_root: Path, reviewer: str) -> str:
    """``git config user.email`` when ``reviewer`` is the configured user, else ``reviewer@localhost``."""
    try:
        cfg = git.Repo(repo_root).config_reader()
        name, email = cfg.get_value("user", "name", default=""), cfg.get_value("user", "email", default="")
    except (OSError, git.InvalidGitRepositoryError):
        name, email = "", ""
    if str(name).strip() == reviewer and str(email).strip():
        return str(email).strip()
    return "reviewer@localhost"


def submit_result(store: ReviewStore, result_path: Path, *, target_branch: str = DEFAULT_TARGET,
                  who: str = "workbench") -> tuple[ReviewItem, bool]:
    """Queue an accepted result file (idempotent per result id).

    Returns:
        ``(item, created)``.

    An accepted result with SKIP verdicts (perf not judged on its device, a model eval that did not apply)
    is queued too: as "accepted, not judged" (:func:`judgement_label`), approvable only with a reason.

    Raises:
        ReviewError: the result was rejected by the guards, it judged a fixture on a fixture base (its
            baseline is the standard path, not the target's merged kernel), or it was queued before with
            other bytes.
        workbench.errors.WorkbenchError: the file is missing or not a result file.
    """
    path = Path(result_path).resolve()
    result = read_result(path)
    if not result.accepted:
        failure = result.first_failure()
        why = f"{failure.guard} {failure.status.value}: {failure.summary}" if failure else "not accepted"
        raise ReviewError(f"Result {path.name} was rejected by the guards ({why}); only accepted candidates "
                          "enter the review queue. Fix the candidate and run it again.")
    c = result.candidate
    if c.set_aside:
        raise ReviewError(f"Result {path.name} judged a fixture on a fixture base ({c.set_aside}); its baseline is "
                          f"not what {target_branch} runs, so it does not enter the review queue. To compare your own kernel "
                          "with the merged one, judge a copy of it kept outside tasks/*/fixtures/ (a copy of a fixture "
                          "that main already merged changes nothing there and is refused as such).")
    return store.add(result_id=result.result_id, result_path=str(path), result_sha256=file_sha256(path),
                     task_id=result.task_id, branch=c.branch, base_commit=c.base_commit,
                     candidate_commit=c.candidate_commit, target_branch=target_branch, who=who)


def load_item_result(item: ReviewItem) -> RunResult:
    """The item's result file, checked against the hash recorded at submission.

    Raises:
        ReviewError: the file is gone, unreadable, or its bytes changed.
    """
    path = Path(item.result_path)
    try:
        result = read_result(path)
    except WorkbenchError as exc:
        raise ReviewError(f"Review item #{item.id}: {exc}") from None
    sha = file_sha256(path)
    if sha != item.result_sha256:
        raise ReviewError(f"Review item #{item.id}: result file {path} changed since submission (sha256 "
                          f"{sha[:12]}, queued as {item.result_sha256[:12]}); the evidence cannot be trusted. "
                          "Re-run `workbench verify` and review the new result.")
    return result


def verdict_refusal(result: RunResult) -> str | None:
    """Why the verdicts forbid a merge, or None: FAIL/ERROR never; SKIP only when the result is accepted."""
    for v in result.verdicts:
        if v.status in (Status.FAIL, Status.ERROR):
            return f"guard {v.guard} is {v.status.value}: {v.summary}"
        if v.status is Status.SKIP and not result.accepted:
            return f"guard {v.guard} was SKIP in a result the guards did not accept: {v.summary}"
    if not result.accepted:
        return "the guards did not accept the result"
    return None


def unjudged_verdicts(result: RunResult) -> tuple[Verdict, ...]:
    """The SKIP verdicts of an accepted result, in pipeline order: what the guards did not judge.

    ``()`` for a rejected result (its SKIPs are guards that an earlier FAIL stopped; it is never approved).
    """
    if not result.accepted:
        return ()
    return tuple(v for v in result.verdicts if v.status is Status.SKIP)


def judgement_label(result: RunResult) -> str:
    """``accepted``, ``accepted, not judged: <guard>, <guard>`` (SKIP verdicts), or ``rejected``."""
    if not result.accepted:
        return "rejected"
    skipped = unjudged_verdicts(result)
    return "accepted, not judged: " + ", ".join(v.guard for v in skipped) if skipped else "accepted"


ACCEPT_UNJUDGED_HOW = ('`workbench review approve ID --accept-unjudged "REASON"`, or the web form\'s '
                       '"accept unjudged" reason')
"""How a reviewer gives the reason for merging a candidate that was not fully judged (CLI and web UI)."""


def unjudged_banner(result: RunResult) -> str | None:
    """One sentence naming every guard that did not judge an accepted result and why, or ``None``.

    Example: ``Accepted, NOT JUDGED: perf (Performance of this task is judged on cuda only, not cpu: ...).
    Approval needs a reason for merging it unjudged (...); the reason goes into the merge commit.``
    """
    skipped = unjudged_verdicts(result)
    if not skipped:
        return None
    what = "; ".join(f"{v.guard} ({v.summary.rstrip('.')})" for v in skipped)
    return (f"Accepted, NOT JUDGED: {what}. Approval needs a reason for merging it unjudged "
            f"({ACCEPT_UNJUDGED_HOW}); the reason goes into the merge commit.")


def unjudged_refusal(item_id: int, result: RunResult, accept_unjudged: str | None) -> str | None:
    """Why the approval cannot go on as asked, given the reviewer's accept-unjudged reason, or ``None``.

    Args:
        accept_unjudged: the reviewer's reason for merging unjudged guards (stripped, non-empty), or ``None``.

    Returns:
        A one-line refusal when the result has SKIP verdicts and no reason was given; ``None`` otherwise.

    Raises:
        ReviewInputError: a reason was given but every guard judged the result (nothing to accept).
    """
    skipped = unjudged_verdicts(result)
    if skipped and accept_unjudged is None:
        what = "; ".join(f"{v.guard} SKIP ({v.summary.rstrip('.')})" for v in skipped)
        return (f"Review item #{item_id} was accepted, not judged: {what}. Approving it needs a reason for merging "
                f"it unjudged ({ACCEPT_UNJUDGED_HOW}); nothing was merged.")
    if not skipped and accept_unjudged is not None:
        raise ReviewInputError(f"Review item #{item_id}: an accept-unjudged reason was given, but every guard judged "
                               "this result (no SKIP verdict); approve it without --accept-unjudged.")
    return None


def merge_message(item: ReviewItem, result: RunResult, reviewer: str, accept_unjudged: str | None = None) -> str:
    """The merge commit message: subject, every verdict line, what was not judged and the reviewer's reason
    for merging it anyway, perf summary, provenance and result hash.

    Args:
        accept_unjudged: the reviewer's reason for merging a result with SKIP verdicts (whitespace runs
            become one space in the ``Accepted-unjudged-reason`` trailer).
    """
    skipped = unjudged_verdicts(result)
    judged = f"accepted, not judged: {', '.join(v.guard for v in skipped)}" if skipped else "accepted"
    lines = [f"Merge {item.branch}: {result.task_id} candidate (review #{item.id})", "",
             f"Approved by {reviewer}; {judged} by the workbench guards on {result.device}.", "", "Evidence:"]
    lines += [f"  {v.one_line()}" for v in result.verdicts]
    if skipped:
        lines += ["", f"Not judged (SKIP), merged on {reviewer}'s reason: {accept_unjudged}"]
        lines += [f"  {v.guard}: {v.summary}" for v in skipped]
    if result.perf:
        lines += ["", "Speedup (baseline / candidate, as the result file reports it, with its CI):"]
        lines += [f"  {p.name:<14} {p.speedup:.3f}x CI [{p.speedup_ci[0]:.3f}, {p.speedup_ci[1]:.3f}] {p.verdict}"
                  for p in result.perf]
    lines += ["", f"Changed-paths: {', '.join(result.candidate.changed_paths)}",
              f"Base-commit: {result.candidate.base_commit}",
              f"Candidate-commit: {result.candidate.candidate_commit}",
              f"Result-file: {Path(item.result_path).name}",
              f"Result-sha256: {item.result_sha256}",
              f"Reproduce: {result.command}"]
    if skipped:
        lines += [f"Accepted-unjudged: {', '.join(v.guard for v in skipped)}",
                  f"Accepted-unjudged-reason: {' '.join(str(accept_unjudged).split())}"]
    return "\n".join(lines + [""])


def refresh_staleness(store: ReviewStore, repo_root: Path, item: ReviewItem, *, who: str) -> tuple[ReviewItem, gitops.MergeCheck]:
    """Check a queued item against its target; mark it stale when the base moved and it no longer merges.

    Raises:
        ReviewError: the target branch or candidate commit is missing.
    """
    chk = gitops.check_merge(git.Repo(repo_root), item.target_branch, item.base_commit, item.candidate_commit)
    if chk.stale and item.state == State.QUEUED.value:
        item = store.transition(item.id, State.QUEUED, State.STALE, who=who,
                                reason=_stale_reason(item, chk))
    return item, chk


def _stale_reason(item: ReviewItem, chk: gitops.MergeCheck) -> str:
    return (f"base moved: {item.target_branch} is at {chk.target_head[:12]}, the candidate was judged on "
            f"{item.base_commit[:12]} and no longer merges cleanly ({', '.join(chk.conflicts[:5])}); "
            f"re-verify: workbench verify {item.task_id} --branch {item.branch} after rebasing.")


def approve(store: ReviewStore, repo_root: Path, item_id: int, *, reviewer: str,
            accept_unjudged: str | None = None) -> ReviewItem:
    """Approve and merge: checks, ``queued -> approved``, merge, ``approved -> merged``.

    An item left ``approved`` by an interrupted merge can be approved again (the merge is redone,
    or recorded if the candidate is already in the target).

    Args:
        accept_unjudged: the reviewer's reason for merging a result with SKIP verdicts ("accepted, not
            judged"); required for such a result, refused for a fully judged one. It goes into the
            ``queued -> approved`` note and the merge commit.

    Returns:
        The item, now ``merged``, with ``merge_commit`` set.

    Raises:
        ReviewInputError: ``accept_unjudged`` is empty or blank, or given for a result every guard judged.
        ReviewError: wrong state, result file changed, a verdict not PASS, a SKIP verdict without an
            ``accept_unjudged`` reason (nothing changes), stale (the item becomes ``stale``), or the merge
            conflicts or the target moved (repository untouched).
    """
    if accept_unjudged is not None:
        accept_unjudged = accept_unjudged.strip()
        if not accept_unjudged:
            raise ReviewInputError(f"Approving review item #{item_id} unjudged needs a reason; pass "
                                   '--accept-unjudged "REASON" (why merging it without those verdicts is right).')
    root = Path(git.Repo(repo_root, search_parent_directories=True).working_dir)
    with git_lock(root):  # one approval at a time per repository: no double merge of one item
        return _approve_locked(store, root, item_id, reviewer=reviewer, accept_unjudged=accept_unjudged)


def _approve_locked(store: ReviewStore, repo_root: Path, item_id: int, *, reviewer: str,
                    accept_unjudged: str | None) -> ReviewItem:
    item = store.get(item_id)
    if item.state not in (State.QUEUED.value, State.APPROVED.value):
        why = f" ({item.reason})" if item.reason else ""
        raise ReviewError(f"Review item #{item_id} is {item.state}{why}; only queued items can be approved.")
    result = load_item_result(item)
    refusal = verdict_refusal(result)
    if refusal:
        raise ReviewError(f"Review item #{item_id} cannot be approved: {refusal}.")
    refusal = unjudged_refusal(item_id, result, accept_unjudged)
    if refusal:
        raise ReviewError(refusal)
    repo = git.Repo(repo_root)
    chk = gitops.check_merge(repo, item.target_branch, item.base_commit, item.candidate_commit)
    if item.state == State.APPROVED.value and repo.is_ancestor(item.candidate_commit, chk.target_head):
        return store.transition(item_id, State.APPROVED, State.MERGED, who=reviewer,
                                note=f"already in {item.target_branch} at {chk.target_head}",
                                merge_commit=chk.target_head)
    if chk.stale:
        reason = _stale_reason(item, chk)
        store.transition(item_id, [State.QUEUED, State.APPROVED] if item.state == State.APPROVED.value else State.QUEUED,
                         State.STALE, who=reviewer, reason=reason)
        raise ReviewError(f"Review item #{item_id} is stale and was not merged: {reason}")
    if item.state == State.QUEUED.value:
        unjudged = ", ".join(v.guard for v in unjudged_verdicts(result))
        store.transition(item_id, State.QUEUED, State.APPROVED, who=reviewer,
                         note=f"approved for {item.target_branch} at {chk.target_head[:12]}"
                              + (f"; accepted unjudged ({unjudged}): {accept_unjudged}" if unjudged else ""))
    try:
        sha = gitops.merge_candidate_locked(Path(repo.working_dir), target_branch=item.target_branch,
                                     base_commit=item.base_commit, candidate_commit=item.candidate_commit,
                                     message=merge_message(item, result, reviewer, accept_unjudged),
                                     author=(reviewer, reviewer_email(Path(repo.working_dir), reviewer)))
    except ReviewError as exc:
        if "conflicts" in str(exc):
            store.transition(item_id, State.APPROVED, State.STALE, who=reviewer, reason=str(exc))
        raise
    return store.transition(item_id, State.APPROVED, State.MERGED, who=reviewer,
                            note=f"merge commit {sha}", merge_commit=sha)


def reject(store: ReviewStore, item_id: int, *, reviewer: str, reason: str) -> ReviewItem:
    """Reject with a reason (from queued, approved-but-unmerged, or stale).

    Raises:
        ReviewInputError: empty reason or unknown id.
        ReviewError: the item is already merged or rejected.
    """
    reason = (reason or "").strip()
    if not reason:
        raise ReviewInputError(f"Rejecting review item #{item_id} needs a reason; pass --reason TEXT "
                          "(what is wrong and what would fix it).")
    item = store.get(item_id)
    if item.state in (State.MERGED.value, State.REJECTED.value):
        raise ReviewError(f"Review item #{item_id} is already {item.state}; it cannot be rejected.")
    return store.transition(item_id, [State.QUEUED, State.APPROVED, State.STALE], State.REJECTED,
                            who=reviewer, reason=reason)
