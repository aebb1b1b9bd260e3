"""``workbench review list|show|approve|reject|submit`` and ``workbench ui``.

Errors come back as one line on stderr. Exit code 2 for bad input (an unknown id, an empty reason, a
store that cannot be opened, an ``--accept-unjudged`` reason that is blank or given for a fully judged
result) in every subcommand; exit code 1 when a review is refused on its merits (approve or reject of an
item in the wrong state, stale, a verdict not PASS, a result with SKIP verdicts approved without
``--accept-unjudged "REASON"``, a conflicting merge).

A result with SKIP verdicts is "accepted, not judged: <guards>" (``workbench.review.service.judgement_label``):
``list`` shows it in its ``judged`` column, ``show`` prints a banner naming each guard and why it did not
judge, and exits 0 (it only reads).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from workbench.errors import WorkbenchError

review_app = typer.Typer(no_args_is_help=True, help="The human review queue: evidence first, approve to merge.")
console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)  # piped: no truncated tables
err = Console(stderr=True, highlight=False, soft_wrap=True)

STATE_STYLE = {"queued": "blue", "approved": "cyan", "merged": "green", "rejected": "red", "stale": "magenta"}
DB_HELP = "SQLAlchemy URL of the queue (default: $WORKBENCH_DB, else sqlite .workbench/queue.db)."
REPO_HELP = "The repository (default: the repo around the cwd)."
REVIEWER_HELP = "Who reviews (default: git config user.name)."


def _root(repo: Path | None) -> Path:
    """The kernel-workbench checkout (a git repository that is not one is refused: no queue is made there).

    Raises:
        RepoError: not inside a git repository, or not a kernel-workbench checkout.
    """
    from workbench.worktree import open_checkout

    return open_checkout(repo or Path.cwd())


def _fail(exc: Exception, code: int = 2) -> None:
    err.print(f"[red]error:[/] {escape(str(exc))}", markup=True)
    raise typer.Exit(code)


def _refused_or_fail(exc: WorkbenchError) -> None:
    """Exit 1 for a review refused on its merits, 2 for bad input (:class:`ReviewInputError`) and the rest."""
    from workbench.review.store import ReviewError, ReviewInputError

    _fail(exc, 1 if isinstance(exc, ReviewError) and not isinstance(exc, ReviewInputError) else 2)


def enqueue_accepted(repo_root: Path, result, result_path: Path) -> None:
    """Called by ``run``/``verify`` after the result file is written: queue it when accepted.

    Prints one line to stderr (stdout's last line stays the result path); a broken store is reported
    and does not change the run's exit code (the result file is the run's product).
    """
    if not result.accepted:
        return
    from workbench.review.service import open_store, submit_result

    try:
        store = open_store(repo_root)
        item, created = submit_result(store, result_path)
        store.close()
    except WorkbenchError as exc:
        err.print(f"[yellow]review queue:[/] not queued: {escape(str(exc))}")
        return
    from workbench.review.service import judgement_label

    label = judgement_label(result)
    note = f", {label}: approving it needs --accept-unjudged \"REASON\"" if label != "accepted" else ""
    err.print(f"review queue: {_queued_line(item, created)}{escape(note)} (workbench review show {item.id})")


def _queued_line(item, created: bool) -> str:
    """``queued as #N``, or for a result submitted before, where it stands (``already submitted as #N
    (merged)``): a merged or rejected item is not "queued" (helper-33, session 27)."""
    return f"queued as #{item.id}" if created else f"already submitted as #{item.id} ({item.state})"


def _open(db: str | None, repo: Path | None, *, create: bool = False):
    """The checkout and its queue; ``create`` only for commands that add to the queue (``submit``): the
    others refuse a ``--db``/``$WORKBENCH_DB`` SQLite file that does not exist (a mistyped path)."""
    from workbench.review.service import open_store

    root = _root(repo)
    return root, open_store(root, db, create=create)


def _state_cell(state: str) -> str:
    return f"[{STATE_STYLE.get(state, 'white')}]{state}[/]"


def _judged_cell(item) -> str:
    """The ``judged`` column of ``review list``: ``accepted``, ``accepted, not judged: perf, ...`` (yellow),
    or why the result file cannot be read (red: ``show`` says more)."""
    from workbench.review import service

    try:
        label = service.judgement_label(service.load_item_result(item))
    except WorkbenchError as exc:
        why = "changed since submission" if "changed since submission" in str(exc) else "unreadable"
        return f"[red]result file {why}[/]"
    return escape(label) if label == "accepted" else f"[yellow]{escape(label)}[/]"


@review_app.command("list")
def list_(
    state: list[str] | None = typer.Option(None, "--state", "-s", help="Only these states (repeatable)."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    repo: Path | None = typer.Option(None, help=REPO_HELP),
) -> None:
    """The queue: one row per candidate, oldest first."""
    from workbench.review.store import State

    try:
        valid = {s.value for s in State}
        bad = [s for s in state or [] if s not in valid]
        if bad:
            raise WorkbenchError(f"--state {bad[0]!r}: expected one of {', '.join(sorted(valid))}.")
        _, store = _open(db, repo)
        items = store.items([State(s) for s in state] if state else None)
    except WorkbenchError as exc:
        _fail(exc)
    t = Table(title=f"review queue ({len(items)})")
    for col in ("id", "task", "state", "judged", "branch", "base", "candidate", "target", "updated (UTC)", "reason"):
        t.add_column(col)
    for it in items:
        t.add_row(str(it.id), escape(it.task_id), _state_cell(it.state), _judged_cell(it), escape(it.branch),
                  it.base_commit[:10], it.candidate_commit[:10], escape(it.target_branch), it.updated_at[:19],
                  escape((it.reason or "")[:60]))
    console.print(t)
    if not items and not state:
        console.print("The queue is empty: `workbench run` queues a candidate the guards accept (unless --no-queue); "
                      "results of tasks/*/fixtures/ candidates are never queued (they are judged on a fixture base).",
                      markup=False)


@review_app.command()
def show(
    item_id: int = typer.Argument(..., help="Queue id."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    repo: Path | None = typer.Option(None, help=REPO_HELP),
) -> None:
    """One candidate: verdicts, perf, changed paths, merge check, history."""
    from workbench.review import gitops, service

    try:
        root, store = _open(db, repo)
        item = store.get(item_id)
        result = service.load_item_result(item)
    except WorkbenchError as exc:
        _fail(exc)
    console.print(f"#{item.id} {item.task_id} {_state_cell(item.state)}  {item.branch} "
                  f"{item.base_commit[:10]} -> {item.candidate_commit[:10]} into {item.target_branch}")
    if item.reason:
        console.print(f"reason: {item.reason}", markup=False)
    if item.merge_commit:
        console.print(f"merge commit: {item.merge_commit}")
    banner = service.unjudged_banner(result)
    if banner:
        console.print(f"[bold yellow]{escape(banner)}[/]")
    else:
        console.print(f"judged: {service.judgement_label(result)} (every guard judged it)", markup=False)
    t = Table(title="verdicts")
    for col in ("guard", "status", "summary"):
        t.add_column(col)
    for v in result.verdicts:
        t.add_row(escape(v.guard), v.status.value, escape(v.summary))
    console.print(t)
    if result.perf:
        p = Table(title="perf (median per call)")
        for col in ("config", "axes", "baseline (us)", "candidate (us)", "speedup", "CI", "verdict"):
            p.add_column(col)
        for r in result.perf:
            p.add_row(escape(r.name), " ".join(f"{k}={v}" for k, v in r.axes.items()), f"{r.baseline_median_us:.1f}",
                      f"{r.candidate_median_us:.1f}", f"{r.speedup:.3f}x",
                      f"[{r.speedup_ci[0]:.3f}, {r.speedup_ci[1]:.3f}]", r.verdict)
        console.print(p)
    console.print(f"changed paths: {', '.join(result.candidate.changed_paths)}", markup=False)
    if item.state in ("queued", "approved"):
        import git

        try:
            chk = gitops.check_merge(git.Repo(root), item.target_branch, item.base_commit, item.candidate_commit)
            console.print("merge: " + ("[magenta]stale[/] (base moved, conflicts: " + ", ".join(chk.conflicts) + ")"
                                       if chk.stale else "clean" + (" (target moved since judgement)" if chk.base_moved else "")))
        except WorkbenchError as exc:
            console.print(f"merge check: {exc}", markup=False)
    console.print(f"reproduce: {result.command}", markup=False)
    h = Table(title="history")
    for col in ("when (UTC)", "who", "from", "to", "note"):
        h.add_column(col)
    for tr in item.transitions:
        h.add_row(tr.at[:23], escape(tr.who), tr.from_state or "", _state_cell(tr.to_state), escape((tr.note or "")[:100]))
    console.print(h)


@review_app.command()
def approve(
    item_id: int = typer.Argument(..., help="Queue id."),
    accept_unjudged: str | None = typer.Option(
        None, "--accept-unjudged", metavar="REASON",
        help="Required when the result has SKIP verdicts (accepted, not judged): why merging it without those "
             "verdicts is right. It goes into the merge commit."),
    reviewer: str | None = typer.Option(None, "--reviewer", help=REVIEWER_HELP),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    repo: Path | None = typer.Option(None, help=REPO_HELP),
) -> None:
    """Approve a queued candidate and merge it into its target branch (refused when stale, not all PASS, or
    not judged by some guard without --accept-unjudged)."""
    from workbench.review import service

    try:
        root, store = _open(db, repo)
        item = service.approve(store, root, item_id, reviewer=reviewer or service.default_reviewer(root),
                               accept_unjudged=accept_unjudged)
    except WorkbenchError as exc:
        _refused_or_fail(exc)
    console.print(f"#{item.id} merged into {item.target_branch} as {item.merge_commit}")


@review_app.command()
def reject(
    item_id: int = typer.Argument(..., help="Queue id."),
    reason: str = typer.Option(..., "--reason", "-r", help="What is wrong and what would fix it."),
    reviewer: str | None = typer.Option(None, "--reviewer", help=REVIEWER_HELP),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    repo: Path | None = typer.Option(None, help=REPO_HELP),
) -> None:
    """Reject a candidate with a reason."""
    from workbench.review import service

    try:
        root, store = _open(db, repo)
        item = service.reject(store, item_id, reviewer=reviewer or service.default_reviewer(root), reason=reason)
    except WorkbenchError as exc:
        _refused_or_fail(exc)
    console.print(f"#{item.id} rejected: {item.reason}", markup=False)


@review_app.command()
def submit(
    result_file: Path = typer.Argument(..., help="An accepted result .json."),
    target: str = typer.Option("main", "--target", help="Branch to merge into on approval."),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    repo: Path | None = typer.Option(None, help=REPO_HELP),
) -> None:
    """Queue a result file by hand (run/verify do it automatically for accepted candidates)."""
    from workbench.review import service

    try:
        _, store = _open(db, repo, create=True)
        item, created = service.submit_result(store, result_file, target_branch=target,
                                              who=service.default_reviewer(repo))
    except WorkbenchError as exc:
        _fail(exc)
    console.print(_queued_line(item, created), markup=False)


def ui(
    host: str = typer.Option("127.0.0.1", help="Interface to listen on (keep 127.0.0.1 unless behind auth)."),
    port: int = typer.Option(8765, help="TCP port."),
    reviewer: str | None = typer.Option(None, "--reviewer", help=REVIEWER_HELP),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    repo: Path | None = typer.Option(None, help=REPO_HELP),
) -> None:
    """Serve the review web UI (the queue, one page per candidate, approve/reject forms).

    The port is bound before anything is printed, and the server is handed that socket: a port already
    taken is a one-line error and exit 2, never a "serving" line followed by uvicorn's traceback.
    """
    import uvicorn

    from workbench.review.web import create_app

    try:
        root, store = _open(db, repo)
        sock = _bind(host, port)
    except WorkbenchError as exc:
        _fail(exc)
    console.print(f"review UI on http://{host}:{port}/ (queue {store.url}); Ctrl-C stops it")
    config = uvicorn.Config(create_app(store, root, reviewer=reviewer), log_level="warning")
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()


def _bind(host: str, port: int):
    """A listening TCP socket on ``host:port`` (uvicorn's own options: SO_REUSEADDR, IPv6 when ``host`` is one).

    Raises:
        WorkbenchError: the port is taken, the address is not this machine's, or the port is out of range.
    """
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(128)
    except (OSError, OverflowError) as exc:
        sock.close()
        why = "it is already in use" if getattr(exc, "errno", None) == errno.EADDRINUSE else f"{type(exc).__name__}: {exc}"
        raise WorkbenchError(f"workbench ui: cannot listen on {host}:{port} ({why}); pick a free port with "
                             "--port N, or stop the program using it.") from None
    sock.set_inheritable(True)
    return sock
