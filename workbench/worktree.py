"""Candidates in isolated git worktrees (gitpython).

Each candidate gets a branch ``wb/<task_id>/<n>`` and a worktree ``.workbench/worktrees/<task_id>-<n>``
created from the base commit; the candidate (a patch, a folder overlaying the repository, or an
existing branch) is applied and committed there, and untracked or ignored leftovers are removed so
the worktree is exactly the candidate commit. Worktree creation holds a file lock so several runs
can start at once.

Source: DESIGN.md "The flow of one candidate".
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import git

from workbench.errors import CandidateError, RepoError

COMMITTER = ("kernel-workbench", "workbench@localhost")
KERNELS_DIR = "k3_model/kernels"
"""Where merged kernels live, one package per op (``k3_model/kernels/<op>/``)."""
logger = logging.getLogger("workbench.worktree")


def state_dir(repo_root: Path) -> Path:
    """``<repo_root>/.workbench`` (git-ignored)."""
    return Path(repo_root) / ".workbench"


def open_repo(path: Path) -> git.Repo:
    """The git repository containing ``path``.

    Raises:
        RepoError: ``path`` is not inside a git repository or it has no commit.
    """
    try:
        repo = git.Repo(path, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise RepoError(
            f"{path} is not inside a git repository; run the workbench from a clone of kernel-workbench."
        ) from None
    try:
        _ = repo.head.commit  # raises ValueError when the repository has no commit
    except ValueError:
        raise RepoError(f"Repository {repo.working_dir} has no commit yet; commit the project first.") from None
    return repo


def open_checkout(path: Path) -> Path:
    """The root of the kernel-workbench checkout containing ``path`` (a git repository with ``tasks/``
    and ``k3_model/``).

    Raises:
        RepoError: ``path`` is not inside a git repository, the repository has no commit, or it is not a
            kernel-workbench checkout.
    """
    root = Path(open_repo(path).working_dir)
    if not (root / "tasks").is_dir() or not (root / "k3_model").is_dir():
        raise RepoError(f"{root} is a git repository but not a kernel-workbench checkout (no tasks/ and k3_model/); "
                        "run the workbench from a clone of kernel-workbench or pass --repo.")
    return root


@contextlib.contextmanager
def git_lock(repo_root: Path) -> Iterator[None]:
    """Exclusive lock for operations that change git state shared by all worktrees."""
    d = state_dir(repo_root)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "git.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A candidate committed in its own worktree.

    Attributes:
        source: what was given (patch path, folder path or branch name).
        kind: ``patch``, ``folder`` or ``branch``.
        branch: the workbench branch holding the candidate commit.
        worktree: the worktree folder.
        base_commit: SHA the diff is taken against.
        candidate_commit: SHA of the candidate.
        set_aside: ``None``, or (a fixture judged on a base that has the op's kernel merged) one sentence
            naming the merged kernel that the fixture base commit sets aside.
        target_base: the base revision the caller named (``base_commit`` unless a fixture base was made).
    """

    source: str
    kind: str
    branch: str
    worktree: Path
    base_commit: str
    candidate_commit: str
    set_aside: str | None = None
    target_base: str = ""

    def __post_init__(self) -> None:
        if not self.target_base:
            object.__setattr__(self, "target_base", self.base_commit)


def classify_source(repo: git.Repo, source: str) -> str:
    """``patch``, ``folder`` or ``branch`` for a ``--candidate`` value (an inject fixture file is a folder).

    Raises:
        CandidateError: it is neither an existing file, an existing folder, nor a git ref.
    """
    from workbench.fixtures import is_inject

    p = Path(source)
    if p.is_file() and is_inject(p):
        return "folder"  # a base fixture plus the bug, materialized into an overlay folder
    if p.is_file():
        return "patch"
    if p.is_dir():
        return "folder"
    try:
        repo.commit(source)
        return "branch"
    except (git.BadName, ValueError, git.GitCommandError):
        raise CandidateError(
            f"Candidate {source!r}: not a patch file, not a folder and not a git branch or commit; "
            "give a path to a .patch file, an overlay folder, or a branch name."
        ) from None


RUN_NUMBERS_FILE = "run_numbers.json"
"""Under ``.workbench/``: the highest run number handed out per task (a high-water mark)."""


def _read_run_numbers(root: Path) -> dict[str, int]:
    """``{task_id: highest run number handed out}``; a missing or unreadable file is empty (the branches
    and worktrees that still exist then bound the next number)."""
    import json

    try:
        data = json.loads((state_dir(root) / RUN_NUMBERS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and type(v) is int} if isinstance(data, dict) else {}


def _next_index(repo: git.Repo, task_id: str, root: Path) -> int:
    """The next run number of ``task_id``, recorded before it is returned (call under :func:`git_lock`).

    Above every existing ``wb/<task_id>/<n>`` branch and ``<task_id>-<n>`` worktree and above the
    high-water mark in ``.workbench/run_numbers.json``, so a number is never handed out twice, not even
    after ``workbench clean --branches`` removed the branches and worktrees that used it.
    """
    import json
    import os

    numbers = _read_run_numbers(root)
    used = [numbers.get(task_id, 0)]
    for head in repo.heads:
        m = re.fullmatch(rf"wb/{re.escape(task_id)}/(\d+)", head.name)
        if m:
            used.append(int(m.group(1)))
    wt = state_dir(root) / "worktrees"
    if wt.is_dir():
        for p in wt.iterdir():
            m = re.fullmatch(rf"{re.escape(task_id)}-(\d+)", p.name)
            if m:
                used.append(int(m.group(1)))
    n = max(used) + 1
    numbers[task_id] = n
    path = state_dir(root) / RUN_NUMBERS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(numbers, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)  # atomic: a killed run leaves the old mark or the new one
    return n


def _committer_env(when: str | None = None) -> dict[str, str]:
    """The workbench's author and committer identity for a git commit (dated ``when``, ISO 8601, if given)."""
    env = {"GIT_AUTHOR_NAME": COMMITTER[0], "GIT_AUTHOR_EMAIL": COMMITTER[1],
           "GIT_COMMITTER_NAME": COMMITTER[0], "GIT_COMMITTER_EMAIL": COMMITTER[1]}
    if when is not None:
        env.update(GIT_AUTHOR_DATE=when, GIT_COMMITTER_DATE=when)
    return env


def _commit_all(wt_repo: git.Repo, message: str) -> str:
    wt_repo.git.add("-A")
    if not wt_repo.git.diff("--cached", "--name-only").strip():
        raise CandidateError("Candidate changes nothing relative to the base commit; there is nothing to judge.")
    wt_repo.git.commit(
        "-m", message, "--no-verify", env=_committer_env(),
    )
    return wt_repo.head.commit.hexsha


def _overlay(src: Path, dst: Path) -> None:
    for item in src.rglob("*"):
        rel = item.relative_to(src)
        if rel.parts and rel.parts[0] == ".git":
            continue
        target = dst / rel
        if item.is_symlink():
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists() or target.is_symlink():
                target.unlink()
            target.symlink_to(item.readlink())
        elif item.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(item, target)


def merged_kernel_files(repo: git.Repo, commit: str, op: str) -> list[str]:
    """Paths of the kernel package merged for ``op`` at ``commit`` (``k3_model/kernels/<op>/`` minus its
    README); empty when none is merged (the package has no ``__init__.py``)."""
    try:
        sub = repo.commit(commit).tree / f"{KERNELS_DIR}/{op}"
    except KeyError:
        return []
    if not any(b.name == "__init__.py" for b in sub.blobs):
        return []
    return sorted(b.path for b in sub.traverse() if b.type == "blob" and Path(b.path).name != "README.md")


def _task_op(root: Path, task_id: str) -> str:
    from workbench.taskspec import load_task

    return load_task(root, task_id).op


def _set_aside_commit(wt_repo: git.Repo, files: list[str], op: str, base_sha: str) -> str:
    """Commit, in the candidate's worktree, the base minus the op's merged kernel (the fixture base). The
    commit is dated as its parent, so the same base always gives the same fixture base SHA."""
    wt_repo.git.rm("-q", "--", *files)
    when = wt_repo.commit(base_sha).committed_datetime.isoformat()
    wt_repo.git.commit(
        "-m", f"fixture base: {base_sha[:10]} with the merged {op} kernel set aside (fixtures are written "
              "against the standard path)", "--no-verify", env=_committer_env(when),
    )
    return wt_repo.head.commit.hexsha


def is_task_fixture(root: Path, task_id: str, source: str) -> bool:
    """Whether ``source`` is a path inside ``tasks/<task_id>/fixtures/`` of the checkout at ``root``."""
    path = Path(source)
    if not path.exists():
        return False
    try:
        path.resolve().relative_to((Path(root) / "tasks" / task_id / "fixtures").resolve())
    except ValueError:
        return False
    return True


def create_candidate(repo_root: Path, task_id: str, source: str, base: str | None = None, *,
                     fixture_base: bool | None = None) -> Candidate:
    """Create the branch and worktree, apply and commit the candidate.

    Args:
        repo_root: the workbench's checkout.
        task_id: used in the branch and folder names.
        source: ``.patch`` file, overlay folder, or branch/commit.
        base: base revision (default: HEAD; for a branch, its merge-base with HEAD).
        fixture_base: for test material written against the standard path (a task's own fixtures, the
            default ``None`` detects them: a source inside ``tasks/<task_id>/fixtures/``; ``True`` forces
            it, ``False`` never): when the base has a kernel merged for the task's op, the candidate is
            built on a **fixture base**, one commit on top of the base that removes that kernel (the
            other ops' merged kernels stay), so it is judged against the standard path. The result says
            so (``Candidate.set_aside``) and is never queued for review (its baseline is not what the
            target runs). Ignored for branches.

    Raises:
        CandidateError: the source is missing, does not apply, or changes nothing (the worktree and
            branch are removed again).
        RepoError: git itself fails.
    """
    repo = open_repo(repo_root)
    root = Path(repo.working_dir)
    kind = classify_source(repo, source)
    base_rev = base or "HEAD"
    try:
        base_sha = repo.commit(base_rev).hexsha
    except (git.BadName, ValueError):
        raise CandidateError(f"Base revision {base_rev!r} does not exist in {root}; give a commit or branch.") from None
    if kind == "branch":
        tip = repo.commit(source).hexsha
        if base is None:
            base_sha = repo.git.merge_base(base_sha, tip)
        if tip == base_sha:
            raise CandidateError(f"Candidate branch {source!r} has no commits beyond its base {base_sha[:10]}; nothing to judge.")
    with git_lock(root):
        n = _next_index(repo, task_id, root)
        branch = f"wb/{task_id}/{n}"
        wt = state_dir(root) / "worktrees" / f"{task_id}-{n}"
        wt.parent.mkdir(parents=True, exist_ok=True)
        start = tip if kind == "branch" else base_sha
        failed: BaseException | None = None
        try:
            repo.git.worktree("add", "-b", branch, str(wt), start)
        except git.GitCommandError as exc:  # git may have made the branch before it failed (or was stopped)
            failed = RepoError(f"git worktree add failed for {wt}: {exc.stderr.strip()}")
        except BaseException as exc:  # Ctrl-C or SIGTERM while git ran
            failed = exc
    if failed is not None:
        remove_candidate(root, wt, branch)  # no stray branch (helper-22, session 21: Ctrl-C during set-up)
        raise failed from None
    set_aside, target_base = None, base_sha
    try:
        wt_repo = git.Repo(wt)
        if fixture_base is None:
            fixture_base = is_task_fixture(root, task_id, source)
        set_aside_op = _task_op(root, task_id) if fixture_base and kind != "branch" else None
        files = merged_kernel_files(repo, base_sha, set_aside_op) if set_aside_op else []
        if files:
            base_sha = _set_aside_commit(wt_repo, files, set_aside_op, target_base)
            set_aside = (f"the {set_aside_op} kernel merged at {target_base[:10]} ({len(files)} file(s) under "
                         f"{KERNELS_DIR}/{set_aside_op}/) is set aside: this fixture is judged against the standard "
                         f"path, on fixture base {base_sha[:10]}")
            logger.info("fixture base: %s", set_aside)
        if kind == "patch":
            try:
                wt_repo.git.apply("--whitespace=nowarn", str(Path(source).resolve()))
            except git.GitCommandError as exc:
                raw = str(exc.stderr).strip().removeprefix("stderr:").strip().strip("'")
                detail = "; ".join(l.strip() for l in raw.splitlines() if l.strip()) or str(exc)
                if not Path(source).read_bytes().strip():
                    detail, fix = "the file is empty", "make the patch with `git diff BASE > candidate.patch`"
                elif "No valid patches" in detail or "only garbage" in detail:
                    fix = "it is not a git patch; make one with `git diff BASE > candidate.patch`"
                else:
                    fix = f"regenerate it against {base_sha[:10]} (git diff from that commit) or pass --base"
                raise CandidateError(
                    f"Candidate patch {source} does not apply to base {base_sha[:10]} ({detail}); {fix}."
                ) from None
            cand_sha = _commit_all(wt_repo, f"candidate for {task_id} from {Path(source).name}")
        elif kind == "folder":
            from workbench.fixtures import overlay_source

            _overlay(overlay_source(Path(source)), wt)
            cand_sha = _commit_all(wt_repo, f"candidate for {task_id} from {Path(source).name}/")
        else:
            cand_sha = tip
        wt_repo.git.clean("-ffdx")  # the worktree must be exactly the candidate commit
    except BaseException:  # KeyboardInterrupt too: a Ctrl-C while the candidate is committed leaves nothing
        remove_candidate(root, wt, branch)
        raise
    return Candidate(source, kind, branch, wt, base_sha, cand_sha, set_aside, target_base)


def checkout_existing(repo_root: Path, task_id: str, branch: str, base: str | None) -> Candidate:
    """Worktree for re-verifying an existing branch (``workbench verify``); same as a branch candidate."""
    return create_candidate(repo_root, task_id, branch, base)


def remove_candidate(repo_root: Path, worktree: Path, branch: str | None = None) -> None:
    """Remove a worktree (and optionally its branch); missing ones are ignored."""
    repo = open_repo(repo_root)
    with git_lock(Path(repo.working_dir)):
        with contextlib.suppress(git.GitCommandError):
            repo.git.worktree("remove", "--force", str(worktree))
        if Path(worktree).exists():
            shutil.rmtree(worktree, ignore_errors=True)
        with contextlib.suppress(git.GitCommandError):
            repo.git.worktree("prune")
        if branch:
            with contextlib.suppress(git.GitCommandError):
                repo.git.branch("-D", branch)


# --- Agent worktrees (issue 4): a branch and worktree at the base, committed attempt by attempt ---------

_GIT_ENV_ALLOW = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "GIT_EXEC_PATH")


def _git_env() -> dict[str, str]:
    """Environment for the workbench's own git commands in agent worktrees: an allowlist, so no API key
    reaches a process git might start (hooks are also switched off on every such command)."""
    import os

    env = {k: os.environ[k] for k in _GIT_ENV_ALLOW if k in os.environ}
    env.update(GIT_AUTHOR_NAME=COMMITTER[0], GIT_AUTHOR_EMAIL=COMMITTER[1],
               GIT_COMMITTER_NAME=COMMITTER[0], GIT_COMMITTER_EMAIL=COMMITTER[1],
               GIT_TERMINAL_PROMPT="0")
    return env


def _git(worktree: Path, *args: str) -> str:
    """Run ``git -C worktree ARGS`` with hooks off and the allowlisted environment.

    Raises:
        RepoError: git exits non-zero (the message carries its stderr).
    """
    import subprocess

    cmd = ["git", "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", "-C", str(worktree), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_git_env(), stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RepoError(f"git {' '.join(args[:2])} failed in {worktree}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


@dataclasses.dataclass(frozen=True)
class AgentWorktree:
    """A worktree an agent edits; each attempt becomes one commit on ``branch``.

    Attributes:
        task_id: the task.
        index: the ``<n>`` in ``wb/<task_id>/<n>`` and ``<task_id>-<n>``.
        branch: the workbench branch.
        worktree: the worktree folder (under ``.workbench/worktrees/``).
        base_commit: SHA every attempt is judged against.
    """

    task_id: str
    index: int
    branch: str
    worktree: Path
    base_commit: str

    @property
    def name(self) -> str:
        """``<task_id>-<n>``: the stem of the brief, run record and transcript files."""
        return f"{self.task_id}-{self.index}"


def create_agent_worktree(repo_root: Path, task_id: str, base: str | None = None) -> AgentWorktree:
    """Create ``wb/<task_id>/<n>`` and its worktree at the base commit, under the git lock.

    Args:
        repo_root: the workbench's checkout.
        task_id: used in the branch and folder names.
        base: base revision (default HEAD).

    Raises:
        CandidateError: the base revision does not exist.
        RepoError: ``git worktree add`` fails.
    """
    repo = open_repo(repo_root)
    root = Path(repo.working_dir)
    base_rev = base or "HEAD"
    try:
        base_sha = repo.commit(base_rev).hexsha
    except (git.BadName, ValueError):
        raise CandidateError(f"Base revision {base_rev!r} does not exist in {root}; give a commit or branch.") from None
    with git_lock(root):
        n = _next_index(repo, task_id, root)
        branch = f"wb/{task_id}/{n}"
        wt = state_dir(root) / "worktrees" / f"{task_id}-{n}"
        wt.parent.mkdir(parents=True, exist_ok=True)
        try:
            repo.git.worktree("add", "-b", branch, str(wt), base_sha)
        except git.GitCommandError as exc:
            raise RepoError(f"git worktree add failed for {wt}: {exc.stderr.strip()}") from None
    return AgentWorktree(task_id, n, branch, wt, base_sha)


def commit_attempt(repo_root: Path, awt: AgentWorktree, message: str) -> tuple[str, bool]:
    """Commit whatever the agent left in its worktree, then remove untracked and ignored leftovers.

    Runs under the git lock (commits of parallel attempts never interleave ref or gc updates), with
    hooks off and an allowlisted environment. After it the worktree is exactly the returned commit:
    stale ``__pycache__`` files or ignored drop-ins cannot reach the guards.

    Returns:
        ``(commit_sha, changed)``; ``changed`` is False when the agent left nothing new (the commit is
        then the previous one).

    Raises:
        RepoError: git fails.
    """
    with git_lock(Path(repo_root)):
        _git(awt.worktree, "add", "-A")
        changed = bool(_git(awt.worktree, "diff", "--cached", "--name-only").strip())
        if changed:
            _git(awt.worktree, "commit", "--no-verify", "-q", "-m", message)
        sha = _git(awt.worktree, "rev-parse", "HEAD").strip()
    _git(awt.worktree, "clean", "-ffdxq")
    return sha, changed


def resolve_branch(repo_root: Path, name: str) -> str:
    """A branch or commit to verify: local first, then ``origin/<name>`` (e.g. in a fresh clone).

    Raises:
        CandidateError: neither exists.
    """
    repo = open_repo(repo_root)
    for ref in (name, f"origin/{name}"):
        try:
            repo.commit(ref)
            return ref
        except (git.BadName, ValueError, git.GitCommandError):
            continue
    raise CandidateError(
        f"Branch {name!r} does not exist in {repo.working_dir} (neither locally nor as origin/{name}); "
        "`git branch --list 'wb/*'` lists the candidate branches."
    )


DEFAULT_CLEAN_AGE_DAYS = 7.0
"""``workbench clean`` removes worktrees last used more than this many days ago (days)."""

HELD_STATES = ("queued", "approved", "stale")
"""Review states whose candidate's worktree ``clean`` keeps (a person may still look at it)."""


@dataclasses.dataclass(frozen=True)
class CleanReport:
    """What :func:`clean_worktrees` did.

    Attributes:
        removed: worktrees removed (count).
        kept_recent: worktrees kept because they were used within ``older_than_days`` (count).
        kept_held: worktrees kept because a review item not yet decided holds their branch (count).
        deleted_branches: ``wb/*`` branches deleted (count).
        freed_bytes: disk space of the removed worktrees (bytes, file sizes, links not followed).
    """

    removed: int
    kept_recent: int
    kept_held: int
    deleted_branches: int
    freed_bytes: int


def _queue_branches(root: Path, states: tuple[str, ...] | None = None) -> set[str]:
    """Branches named by the default review queue (``.workbench/queue.db``), optionally only items in
    ``states``; no queue, or an unreadable one, names none."""
    db = state_dir(root) / "queue.db"
    if not db.is_file():
        return set()
    import sqlite3

    query, args = "select branch from review_items", ()
    if states:
        query += f" where state in ({', '.join('?' * len(states))})"
        args = states
    with contextlib.closing(sqlite3.connect(db)) as con:
        with contextlib.suppress(sqlite3.Error):
            return {row[0] for row in con.execute(query, args)}
    return set()


def _worktree_branches(repo: git.Repo) -> dict[Path, str]:
    """``{worktree folder: branch name}`` from ``git worktree list --porcelain`` (detached ones left out)."""
    out: dict[Path, str] = {}
    path = None
    for line in repo.git.worktree("list", "--porcelain").splitlines():
        if line.startswith("worktree "):
            path = Path(line[len("worktree "):]).resolve()
        elif line.startswith("branch refs/heads/") and path is not None:
            out[path] = line[len("branch refs/heads/"):]
    return out


def _last_used_s(wt: Path) -> float:
    """When a worktree was last changed (seconds since the epoch): its folder, its ``.git`` file and its
    git admin folder's HEAD, index and reflog (a commit of an agent's attempt touches those)."""
    paths = [wt, wt / ".git"]
    with contextlib.suppress(OSError, IndexError):
        admin = Path((wt / ".git").read_text().split("gitdir:", 1)[1].strip())
        paths += [admin / "HEAD", admin / "index", admin / "logs" / "HEAD"]
    return max((p.lstat().st_mtime for p in paths if p.exists() or p.is_symlink()), default=0.0)


def _tree_bytes(path: Path) -> int:
    """Sum of the sizes of the files under ``path`` (bytes; links counted as links, never followed)."""
    import os

    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def clean_worktrees(repo_root: Path, *, delete_branches: bool = False,
                    older_than_days: float = DEFAULT_CLEAN_AGE_DAYS) -> CleanReport:
    """Remove candidate worktrees of finished runs; optionally delete ``wb/*`` branches the queue does not hold.

    A worktree is removed when it was last used more than ``older_than_days`` days ago (0: every one) and
    no review item in a state of :data:`HELD_STATES` names its branch. A run still in progress uses its
    worktree now, so it is never old enough.

    Args:
        repo_root: the workbench's checkout.
        delete_branches: also delete every ``wb/*`` branch no review item names (a branch still checked out
            in a kept worktree stays).
        older_than_days: age in days (>= 0) below which a worktree is kept.

    Returns:
        A :class:`CleanReport` (counts and the bytes freed).

    Raises:
        RepoError: ``repo_root`` is not in a git repository.
        ValueError: ``older_than_days`` is negative.
    """
    import time

    if older_than_days < 0:
        raise ValueError(f"--older-than-days {older_than_days:g}: expected a number of days >= 0 (0 removes "
                         "every worktree the review queue does not hold).")
    repo = open_repo(repo_root)
    root = Path(repo.working_dir)
    wt_dir = state_dir(root) / "worktrees"
    removed = kept_recent = kept_held = freed = 0
    if wt_dir.is_dir():
        held = _queue_branches(root, HELD_STATES)
        branches = _worktree_branches(repo)
        cutoff = time.time() - older_than_days * 86400.0
        for wt in sorted(wt_dir.iterdir()):
            if branches.get(wt.resolve()) in held:
                kept_held += 1
            elif older_than_days > 0 and _last_used_s(wt) > cutoff:
                kept_recent += 1
            else:
                size = _tree_bytes(wt)
                remove_candidate(root, wt)
                freed += size
                removed += 1
    deleted = 0
    if delete_branches:
        keep = _queue_branches(root)
        with git_lock(root):
            for head in list(repo.heads):
                if head.name.startswith("wb/") and head.name not in keep and head.name != repo.active_branch.name:
                    try:
                        repo.git.branch("-D", head.name)
                        deleted += 1
                    except git.GitCommandError:  # checked out in another worktree: leave it
                        continue
    return CleanReport(removed, kept_recent, kept_held, deleted, freed)
