"""The ``workbench`` command line.

Exit codes of ``run`` and ``verify``: 0 accepted, 1 rejected, 2 bad input or infrastructure error,
3 correct but perf not judged on this device (the task times it elsewhere: never a plain accept; it is
queued as "accepted, not judged: perf", and approving it needs ``--accept-unjudged "REASON"``); the last
line printed is the result file's path. No torch import at
module level (fast ``--help``).

Terminal markup: a string printed with rich markup carries only the workbench's own style tags; every
value inside it (a verdict's summary, a path, an error) goes through ``rich.markup.escape``, and plain
lines are printed with ``markup=False``, so text in square brackets is never taken for a tag and
dropped (issue 20: the console lost "[cuda_event ...]" from a reason the feedback file kept).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from workbench.errors import CandidateError, WorkbenchError


class _VerboseAnywhere(typer.core.TyperGroup):
    """The top-level group: ``-v``/``--verbose`` may follow any subcommand (``workbench tasks -v``, ``workbench
    review list -v``): each such token before a ``--`` moves in front of the subcommand, where the group's own
    option reads it (commands that declare ``-v`` themselves set the same logging)."""

    def parse_args(self, ctx, args):
        cut = args.index("--") if "--" in args else len(args)
        flags = [a for a in args[:cut] if a in ("-v", "--verbose")]
        if flags and args[:1] not in (["-v"], ["--verbose"]):
            args = ["-v"] + [a for a in args[:cut] if a not in ("-v", "--verbose")] + args[cut:]
        return super().parse_args(ctx, args)


app = typer.Typer(add_completion=False, no_args_is_help=True, cls=_VerboseAnywhere,
                  help="kernel-workbench: judge kernel candidates for K3 with guards, keep the evidence.")
console = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)  # piped: no truncated tables
err = Console(stderr=True, highlight=False, soft_wrap=True)

EXIT_ACCEPTED, EXIT_REJECTED, EXIT_ERROR, EXIT_PERF_NOT_JUDGED = 0, 1, 2, 3
STATUS_STYLE = {"PASS": "green", "FAIL": "red", "ERROR": "magenta", "SKIP": "dim"}
ACCEPTANCE_STYLE = {"accepted": "green", "correct_perf_not_judged": "yellow", "rejected": "red"}


def _root(repo: Path | None) -> Path:
    from workbench.worktree import open_checkout

    try:
        return open_checkout(repo or Path.cwd())
    except WorkbenchError as exc:
        _fail(exc)
        raise  # unreachable: _fail exits


def _print_result(result, path: Path) -> None:
    style = ACCEPTANCE_STYLE[result.acceptance]
    console.print(f"{escape(result.task_id)} candidate {escape(result.candidate.source)}: [{style}]{result.acceptance_label}[/]")
    for v in result.verdicts:
        style = STATUS_STYLE[v.status.value]
        console.print(f"  {escape(f'{v.guard:<12}')} [{style}]{v.status.value:<5}[/] {escape(v.summary)}")
    if result.acceptance == "correct_perf_not_judged":
        from workbench.report import perf_not_judged_note

        console.print(f"  [yellow]{escape(perf_not_judged_note(result))}[/]")
    if result.candidate.set_aside:
        console.print(f"  [yellow]baseline: {escape(result.candidate.set_aside)}[/]")
    console.print(str(path), markup=False)


def _exit_code(result) -> int:
    """0 accepted, 3 correct with perf not judged, 2 when a guard broke (ERROR: the verdict is not a
    judgement), else 1."""
    if result.accepted:
        return EXIT_ACCEPTED if result.perf_judged else EXIT_PERF_NOT_JUDGED
    return EXIT_ERROR if any(v.status.value == "ERROR" for v in result.verdicts) else EXIT_REJECTED


def _enqueue(root: Path, result, path: Path, no_queue: bool) -> None:
    """Put an accepted result in the review queue; one with SKIP verdicts (perf not judged on this device,
    a model eval that did not apply) is queued as "accepted, not judged" and approved only with a reason
    (``workbench review approve ID --accept-unjudged "REASON"``; issue 15 item 4)."""
    if no_queue or not result.accepted:
        return
    from workbench.review.cli import enqueue_accepted

    enqueue_accepted(root, result, path)


EXIT_INTERRUPTED = 130
"""128 + SIGINT, the shell's code for a command stopped by Ctrl-C."""
EXIT_TERMINATED = 143
"""128 + SIGTERM (``kill``, ``timeout``, a CI runner stopping a job)."""


@contextlib.contextmanager
def _judging() -> Iterator[None]:
    """Show the judgment's progress on stderr; on Ctrl-C or SIGTERM stop every child, remove the half-made
    worktree and branch, say what was interrupted, exit 130 (SIGINT) or 143 (SIGTERM)."""
    import signal
    import threading

    from guards import progress
    from guards.sandbox import kill_all_children
    from workbench.progress_view import showing_progress

    got: list[int] = []

    def on_signal(signum, frame):  # record it too: a KeyboardInterrupt raised inside a finalizer is lost
        got.append(signum)
        progress.request_interrupt()
        raise KeyboardInterrupt

    progress.clear_interrupt()
    main = threading.current_thread() is threading.main_thread()
    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        with showing_progress(err):
            yield
    except KeyboardInterrupt as exc:
        from workbench.errors import Interrupted

        groups = kill_all_children()  # again: a child started while the handler ran dies too
        note = exc.note if isinstance(exc, Interrupted) else f"Interrupted: stopped {groups} child process group(s)."
        term = bool(got) and got[0] == signal.SIGTERM
        err.print(f"[yellow]{escape(('SIGTERM: ' if term else '') + note)}[/]")
        raise typer.Exit(EXIT_TERMINATED if term else EXIT_INTERRUPTED) from None
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        progress.clear_interrupt()


def _fail(exc: Exception) -> None:
    err.print(f"[red]error:[/] {escape(str(exc))}")
    raise typer.Exit(EXIT_ERROR)


VERBOSE_HELP = "Log every dispatch decision and guard step (before or after the subcommand)."


def _verbosity(verbose: bool) -> None:
    """``-v``: debug logging of the workbench's own loggers (dispatch decisions, guard steps) on stderr."""
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    if verbose:
        for name in ("workbench", "guards", "k3_model", "vllm.k3_model"):
            logging.getLogger(name).setLevel(logging.DEBUG)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP)) -> None:
    _verbosity(verbose)


def _model_eval_vllm(on: bool) -> None:
    """``--model-eval-vllm``: the model-eval guard reads its settings from the environment (guards/model_eval.py),
    so this exports ``WORKBENCH_MODEL_EVAL_VLLM=on`` (workbench/envs.py); the reproduce command repeats it."""
    if on:
        from workbench import envs

        envs.MODEL_EVAL_VLLM.export("on")


TaskArg = Annotated[str, typer.Argument(help="Task id (a folder under tasks/).")]
BaseOpt = Annotated[str | None, typer.Option("--base", help="Base revision (default HEAD; for a branch, its merge-base).")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda or auto.")]
RepoOpt = Annotated[Path | None, typer.Option("--repo", help="The workbench checkout (default: the repo around the cwd).")]
NoQueueOpt = Annotated[bool, typer.Option("--no-queue", help="Do not put an accepted candidate in the review queue.")]
ModelEvalVllmOpt = Annotated[bool, typer.Option("--model-eval-vllm", help="Also run the model eval through vLLM "
                                                "(CPU, when vllm is importable; its environment variable is in "
                                                "workbench/envs.py).")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help=VERBOSE_HELP)]
PoolOpt = Annotated[str | None, typer.Option("--pool", help="Where verdicts are judged: local (this process, one "
                    "at a time) or ray://HOST:PORT (a Ray cluster's client address; needs the pool extra). Default: "
                    "$WORKBENCH_POOL, else local.")]
"""The options ``run``, ``verify`` and ``agent`` share (one declaration each, the same names and help in all)."""
ParallelOpt = Annotated[int, typer.Option("--parallel", help="Agent runs at once, each in its own worktree with its own "
                        "attempts and feedback; their verdicts share the pool (count, at least 1).")]

def _pool_line(label: str, entry) -> None:
    """The pool's progress on stderr: one line per change of a verdict's state (queued, running, done, error)."""
    where = f" on {entry.node} (pid {entry.pid}, try {entry.tries})" if entry.state == "running" else ""
    note = f": {entry.note}" if entry.note and entry.state in ("done", "error") else ""
    err.print(f"pool: {label} {entry.state}{where}{note}", markup=False, highlight=False)


@contextlib.contextmanager
def _pool(spec: str | None, *, inline_local: bool = True) -> Iterator:
    """The pool ``--pool`` names (``$WORKBENCH_POOL`` when not given), closed on the way out; ``None`` for the
    local pool when ``inline_local`` (one verdict at a time anyway: judged inline, exactly as before).

    Raises:
        PoolError: see :func:`workbench.pool.open_pool`.
    """
    from workbench import envs
    from workbench.pool import LocalPool, open_pool

    spec = spec if spec is not None else envs.POOL.read()
    pool = open_pool(spec, on_change=_pool_line)
    try:
        yield None if inline_local and isinstance(pool, LocalPool) else pool
    finally:
        pool.close()


BACKENDS = ("anthropic", "command", "patch")
"""``workbench agent --backend`` values: the API tool loop, a command-line agent, a fixed candidate."""


@app.command()
def run(
    task_id: TaskArg,
    candidate: str | None = typer.Option(None, "--candidate", "-c", help="A .patch file, an overlay folder, or a branch."),
    base: BaseOpt = None,
    device: DeviceOpt = "auto",
    seed: int | None = typer.Option(None, min=0, max=2**31 - 1, help="Run-time seed, 0 to 2**31 - 1 (default: random, recorded in the result)."),
    repo: RepoOpt = None,
    no_queue: NoQueueOpt = False,
    model_eval_vllm: ModelEvalVllmOpt = False,
    agent: str | None = typer.Option(None, "--agent", hidden=True, help="Moved: `workbench agent --backend`."),
    pool: PoolOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Judge a candidate you already have (a patch, an overlay folder or a branch) against the base."""
    _verbosity(verbose)
    if agent is not None:
        _fail(WorkbenchError(f"run judges a given candidate; letting an agent write one is its own command: "
                             f"workbench agent {task_id} --backend {agent} (see `workbench agent --help`)."))
    if candidate is None:
        _fail(WorkbenchError("run: give --candidate PATCH|FOLDER|BRANCH; to let an agent write one, use "
                             f"`workbench agent {task_id} --backend anthropic|command`."))
    _model_eval_vllm(model_eval_vllm)
    from workbench.pipeline import run_candidate

    try:
        with _pool(pool) as judged_by, _judging():
            result, path = run_candidate(_root(repo), task_id, candidate, base=base, device=device, seed=seed,
                                         pool=judged_by)
    except (WorkbenchError, ValueError) as exc:
        _fail(exc)
    _enqueue(_root(repo), result, path, no_queue)
    _print_result(result, path)
    raise typer.Exit(_exit_code(result))


@app.command()
def agent(
    task_id: TaskArg,
    backend: str = typer.Option(..., "--backend", "-b", help="anthropic (API tool loop), command (--agent-cmd) or "
                                "patch (a fixed --candidate, judged as one attempt)."),
    attempts: int = typer.Option(1, "--attempts", help="Attempts; after a rejection the agent gets the evidence and tries again."),
    agent_cmd: str | None = typer.Option(None, "--agent-cmd", help="Command template for --backend command, e.g. 'claude -p {prompt}'."),
    agent_env: list[str] | None = typer.Option(None, "--agent-env", help="Variable passed to the command agent "
        "(repeatable); it gets no others but PATH, LANG, LC_ALL, TERM, TZ."),
    model: str | None = typer.Option(None, "--model", help="Model for --backend anthropic (default claude-sonnet-4-6)."),
    max_turns: int | None = typer.Option(None, "--max-turns", help="API calls per attempt (anthropic; default 40)."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", help="Tokens per response (anthropic; default 16000)."),
    budget_s: float | None = typer.Option(None, "--budget-s", help="Wall-clock budget per attempt, seconds (default 1800)."),
    candidate: str | None = typer.Option(None, "--candidate", "-c", help="The fixed candidate of --backend patch."),
    seed: int | None = typer.Option(None, hidden=True, help="Refused: every attempt draws its own seed."),
    base: BaseOpt = None,
    device: DeviceOpt = "auto",
    repo: RepoOpt = None,
    no_queue: NoQueueOpt = False,
    model_eval_vllm: ModelEvalVllmOpt = False,
    parallel: ParallelOpt = 1,
    pool: PoolOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """Let an agent write a candidate in its own worktree; judge each attempt and feed a rejection back to it.

    With --parallel N, N runs go at once (each its own worktree, branch and attempts); the exit code is
    0 when any run was accepted, else the first run's.
    """
    _verbosity(verbose)
    _model_eval_vllm(model_eval_vllm)
    _run_agent_cli(task_id, agent=backend, candidate=candidate, attempts=attempts, agent_cmd=agent_cmd,
                   agent_env=agent_env or [], model=model, max_turns=max_turns, max_tokens=max_tokens,
                   budget_s=budget_s, base=base, device=device, seed=seed, repo=repo, no_queue=no_queue,
                   parallel=parallel, pool=pool)


def _run_agent_cli(task_id: str, *, agent: str, candidate: str | None, attempts: int, agent_cmd: str | None,
                   agent_env: list[str], model: str | None, max_turns: int | None, max_tokens: int | None,
                   budget_s: float | None, base: str | None, device: str, seed: int | None,
                   repo: Path | None, no_queue: bool = False, parallel: int = 1, pool: str | None = None) -> None:
    """``workbench agent``: build the backend from the options, run the attempts (``parallel`` runs at once,
    verdicts judged by ``pool``), print each verdict."""
    from workbench.pool import check_parallel

    log = logging.getLogger("workbench.cli")
    try:
        check_parallel(parallel)
        if seed is not None:
            raise WorkbenchError("--seed is not used by `workbench agent`: every attempt draws a fresh run-time seed "
                                 "(recorded in its result file).")
        if agent not in BACKENDS:
            raise WorkbenchError(f"--backend {agent!r}: expected {', '.join(BACKENDS)}.")
        if attempts < 1:
            raise WorkbenchError(f"--attempts {attempts}: must be at least 1.")
        if agent != "command" and (agent_cmd or agent_env):
            raise WorkbenchError("--agent-cmd and --agent-env belong to --backend command.")
        if agent != "anthropic" and (model or max_turns is not None or max_tokens is not None):
            raise WorkbenchError("--model, --max-turns and --max-tokens belong to --backend anthropic.")
        if agent != "patch" and candidate:
            raise WorkbenchError(f"--candidate belongs to --backend patch, not --backend {agent}.")
        root = _root(repo)

        def make_backend():
            if agent == "anthropic":
                from workbench.agents.anthropic_backend import AnthropicBackend

                kw = {k: v for k, v in (("model", model), ("max_turns", max_turns), ("max_tokens", max_tokens),
                                        ("budget_s", budget_s)) if v is not None}
                return AnthropicBackend(**kw)
            if agent == "command":
                from workbench.agents.command_backend import CommandBackend

                if not agent_cmd:
                    raise WorkbenchError("--backend command needs --agent-cmd TEMPLATE, e.g. --agent-cmd 'claude -p {prompt}'.")
                return CommandBackend(agent_cmd, env_allow=agent_env,
                                      **({"budget_s": budget_s} if budget_s is not None else {}))
            from workbench.agents.patch_backend import PatchBackend

            if not candidate:
                raise WorkbenchError("--backend patch needs --candidate PATCH|FOLDER|BRANCH.")
            if attempts != 1:
                raise WorkbenchError(f"--attempts {attempts}: the patch backend judges one fixed candidate; "
                                     "use --backend anthropic or command to iterate.")
            return PatchBackend(candidate, root)

        backends = [make_backend() for _ in range(parallel)]  # one per run: a backend keeps per-run state
        log.info("dispatch: %d run(s) of %s with backend %s, %d attempt(s) each", parallel, task_id,
                 backends[0].label, attempts)
        from workbench.agents.runner import run_agent

        with _pool(pool, inline_local=parallel == 1) as judged_by, _judging():
            if parallel == 1:
                runs = [run_agent(root, task_id, backends[0], attempts=attempts, base=base, device=device,
                                  pool=judged_by)]
            else:
                from concurrent.futures import ThreadPoolExecutor

                ex = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="agent-run")
                try:
                    futures = [ex.submit(run_agent, root, task_id, b, attempts=attempts, base=base, device=device,
                                         pool=judged_by) for b in backends]
                    runs = [f.result() for f in futures]
                finally:  # Ctrl-C: do not wait here for the runs; _judging kills their children, the pool cancels
                    ex.shutdown(wait=False, cancel_futures=True)
    except (WorkbenchError, ValueError) as exc:
        _fail(exc)
    from workbench.results import read_result

    codes = []
    for n, result in enumerate(runs, 1):
        if parallel > 1:
            console.rule(escape(f"run {n}/{parallel}: {result.branch}"))
        for rec in result.attempts:
            r = read_result(Path(rec.result_path))
            console.rule(escape(f"attempt {rec.attempt}/{attempts}: {rec.outcome['stop_reason']}, commit {rec.commit[:10]}"))
            _print_result(r, Path(rec.result_path))
        u = result.usage
        cost = "unknown (model not in the price table)" if u.cost_usd is None else f"${u.cost_usd:.4f}"
        if u.api_calls:
            console.print(f"tokens: {u.input_tokens} in, {u.output_tokens} out, {u.cache_read_input_tokens} cache read, "
                          f"{u.cache_creation_input_tokens} cache write over {u.api_calls} calls; cost {cost}")
        console.print(f"run record: {result.record_path}", markup=False)
        if result.final_path is None:
            _fail(WorkbenchError(f"no attempt of run {result.branch} was judged."))
        _enqueue(root, result.final, result.final_path, no_queue)
        console.print(str(result.final_path), markup=False)
        codes.append(_exit_code(result.final))
    raise typer.Exit(EXIT_ACCEPTED if EXIT_ACCEPTED in codes else codes[0])


@app.command()
def verify(
    task_id: str = typer.Argument(..., help="Task id."),
    branch: str = typer.Option(..., "--branch", "-b", help="Branch (or commit) holding the candidate."),
    base: str | None = typer.Option(None, help="Base revision (default: merge-base with HEAD)."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    seed: int | None = typer.Option(None, min=0, max=2**31 - 1, help="Run-time seed, 0 to 2**31 - 1."),
    repo: Path | None = typer.Option(None, help="The workbench checkout."),
    no_queue: bool = typer.Option(False, "--no-queue", help="Do not put an accepted candidate in the review queue."),
    model_eval_vllm: ModelEvalVllmOpt = False,
    pool: PoolOpt = None,
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
) -> None:
    """Re-run every guard on an existing branch (e.g. on your own GPU) and write a new result file.

    The branch is judged in a fresh worktree on a new wb/<task>/<n> branch at the same commit.
    """
    _verbosity(verbose)
    _model_eval_vllm(model_eval_vllm)
    from workbench.pipeline import run_candidate
    from workbench.worktree import resolve_branch

    try:
        root = _root(repo)
        ref = resolve_branch(root, branch)
        with _pool(pool) as judged_by, _judging():
            result, path = run_candidate(root, task_id, ref, base=base, device=device, seed=seed, pool=judged_by)
    except (WorkbenchError, ValueError) as exc:
        _fail(exc)
    _enqueue(root, result, path, no_queue)
    _print_result(result, path)
    raise typer.Exit(_exit_code(result))


@app.command()
def clean(
    branches: bool = typer.Option(False, "--branches", help="Also delete wb/* branches that the review queue does not reference."),
    older_than_days: float = typer.Option(7.0, "--older-than-days", help="Remove worktrees last used more than this many days ago (0: all)."),
    repo: Path | None = typer.Option(None, help="The workbench checkout."),
) -> None:
    """Remove worktrees of finished runs under .workbench/worktrees (result files, transcripts and the queue stay).

    Worktrees used within --older-than-days days (a run in progress) and those of candidates still in the
    review queue (queued, approved, stale) are kept; the line printed says how much disk was freed.
    """
    from rich.filesize import decimal

    from workbench.worktree import clean_worktrees

    try:
        r = clean_worktrees(_root(repo), delete_branches=branches, older_than_days=older_than_days)
    except (WorkbenchError, ValueError) as exc:
        _fail(exc)
    kept = [f"{r.kept_recent} used within {older_than_days:g} day(s)"] if r.kept_recent else []
    kept += [f"{r.kept_held} held by the review queue"] if r.kept_held else []
    console.print(f"removed {r.removed} worktree(s), freed {decimal(r.freed_bytes)}"
                  + (f"; kept {' and '.join(kept)}" if kept else "")
                  + (f"; deleted {r.deleted_branches} branch(es)" if branches else ""), markup=False)


@app.command()
def report(result_file: Path = typer.Argument(..., help="A result .json written by run/verify.")) -> None:
    """Print a result file's Markdown report."""
    from workbench.report import render_markdown
    from workbench.results import read_result

    try:
        r = read_result(result_file)
    except WorkbenchError as exc:
        _fail(exc)
    console.print(render_markdown(r), markup=False)


@app.command()
def compare(a: Path = typer.Argument(..., help="First result file."), b: Path = typer.Argument(..., help="Second result file.")) -> None:
    """Compare two result files of the same task (e.g. yours and the reviewer's) configuration by configuration."""
    from workbench.results import read_result

    try:
        ra, rb = read_result(a), read_result(b)
    except WorkbenchError as exc:
        _fail(exc)
    if ra.task_id != rb.task_id:
        _fail(WorkbenchError(f"Result files are for different tasks ({ra.task_id} vs {rb.task_id}); compare runs of one task."))
    console.print(_same_candidate(ra, rb), markup=False)
    console.print(_side_by_side(f"{ra.task_id}: {a.name} (A) vs {b.name} (B), guard by guard", "guard", ("", "says"),
                                {v.guard: v for v in ra.verdicts}, {v.guard: v for v in rb.verdicts},
                                lambda v: (v.status.value, escape(_clip(v.summary, 70))), ("-", "")))
    if not ra.perf and not rb.perf:
        # a result rejected before perf (or judged where perf is not) has no timings: say so, no empty table
        console.print("No perf rows in either result: perf did not time them (see the perf guard above).", markup=False)
    else:
        console.print(_side_by_side(f"{ra.task_id}: perf, configuration by configuration", "config", ("speedup", "verdict"),
                                    {p.name: p for p in ra.perf}, {p.name: p for p in rb.perf},
                                    lambda p: (f"{p.speedup:.3f}x", p.verdict), ("-", "-")))
        console.print(_PERF_LEGEND, markup=False)
    where = lambda r: f"{r.device} {r.environment.get('gpu_name') or ''}".strip()  # noqa: E731
    console.print(f"A: {ra.acceptance_label.lower()} on {where(ra)}; B: {rb.acceptance_label.lower()} on {where(rb)}",
                  markup=False)


_PERF_LEGEND = ("gain / no_gain: a configuration the kernel claims (a speedup of at least the task's min_speedup "
                "is required); neutral: listed or drawn at run time (random-perf-*) only to look for a regression, "
                "none found; not_claimed: outside the kernel's scope, not timed; any other verdict fails the guard.")
"""What the perf table's verdicts mean (``guards.perf_status.PerfStatus``), printed under it."""


def _same_candidate(ra, rb) -> str:
    """One line: whether two results judged the same candidate code (their content keys,
    ``workbench.retries.content_key``), with each side's candidate commit and seed."""
    sides = f"A: candidate {ra.candidate.candidate_commit[:10]}, seed {ra.seed}; B: candidate {rb.candidate.candidate_commit[:10]}, seed {rb.seed}"
    if ra.content_key and ra.content_key == rb.content_key:
        return f"A and B judged the same candidate code ({sides})."
    if ra.content_key and rb.content_key:
        return f"A and B judged DIFFERENT candidate code ({sides}): their differences may be the code's, not the draws'."
    return f"Whether A and B judged the same code is not recorded in both results ({sides})."


def _side_by_side(title: str, key: str, fields: tuple[str, ...], a: dict, b: dict, cells, missing: tuple) -> Table:
    """One row per name of ``a`` (in its order), then of ``b`` alone: each field's A cell, then its B cell
    (``cells(x)`` gives a side's cells, ``missing`` stands in for a side without the name)."""
    t = Table(title=escape(title))
    t.add_column(key)
    for f in fields:
        t.add_column(f"A {f}".strip())
        t.add_column(f"B {f}".strip())
    for name in [*a, *(n for n in b if n not in a)]:
        ca = cells(a[name]) if name in a else missing
        cb = cells(b[name]) if name in b else missing
        t.add_row(escape(name), *(c for pair in zip(ca, cb) for c in pair))
    return t


def _clip(text: str, n: int) -> str:
    """``text`` on one line, cut to ``n`` characters with an ellipsis."""
    one = " ".join(text.split())
    return one if len(one) <= n else one[: n - 1] + "\u2026"


@app.command()
def tasks(repo: Path | None = typer.Option(None, help="The workbench checkout.")) -> None:
    """List the tasks and their allowed paths.

    A task whose task.toml does not load is listed as invalid and its whole error is printed on
    stderr (one line per task); the valid tasks are still listed, and the exit code is then 2.
    """
    from workbench.taskspec import check_target, list_task_ids, load_task

    root = _root(repo)
    t = Table(title="tasks")
    for col in ("task", "op", "target", "allowed paths", "workloads"):
        t.add_column(col)
    problems: list[WorkbenchError] = []
    for tid in list_task_ids(root):
        try:
            s = load_task(root, tid)
            check_target(root, s)
        except WorkbenchError as exc:
            problems.append(exc)
            t.add_row(escape(tid), "[red]invalid[/]", "see the error below", "", "")
            continue
        t.add_row(*(escape(x) for x in (tid, s.op, s.target, ", ".join(s.allowed_paths), str(len(s.correctness.workloads)))))
    console.print(t)
    for exc in problems:
        err.print(f"[red]error:[/] {escape(str(exc))}")
    if problems:
        raise typer.Exit(EXIT_ERROR)


def _judge_fixtures(root: Path, task_id: str, names: list[str] | None, device: str, seed: int | None,
                    base: str | None = None) -> bool:
    from workbench.fixtures import fixture_name, fixture_outcome_ok, list_fixtures
    from workbench.pipeline import detect_device, run_candidate
    from workbench.taskspec import load_task

    spec = load_task(root, task_id)
    fixtures = list_fixtures(spec)
    if names:  # a fixture's file name works too (isolation-edits-test.patch, x.inject.toml)
        names = [fixture_name(n) for n in names]
        unknown = sorted(set(names) - {f.name for f in fixtures})
        if unknown:
            raise WorkbenchError(f"Task {task_id!r} has no fixture {unknown[0]!r}; known: {', '.join(f.name for f in fixtures)}.")
        fixtures = [f for f in fixtures if f.name in names]
    all_ok = True
    dev = detect_device(device)
    t0, tally = time.monotonic(), {"as expected": 0, "NOT as expected": 0, "skipped": 0}
    for fx in fixtures:
        if not fx.runs_on(dev):
            console.print(f"skip fixture {fx.name}: judged on {', '.join(fx.devices or ())} only (fixtures/requires.toml)",
                          markup=False)
            tally["skipped"] += 1
            continue
        expect = "accepted" if fx.good else f"rejected by {fx.expected_guard}"
        console.rule(escape(f"{'good' if fx.good else 'bad'} fixture {fx.name} (expected: {expect})"))
        try:
            with _judging():
                result, path = run_candidate(root, task_id, str(fx.defined_in or fx.path), base=base, device=device,
                                             seed=seed)
        except CandidateError as exc:
            if "changes nothing" not in str(exc):
                raise
            console.print(f"  => [yellow]skipped[/]: {escape(fx.name)} is already merged at the base (its files are in HEAD), "
                          "so there is nothing to judge")
            tally["skipped"] += 1
            continue
        failure = result.first_failure()
        ok = fixture_outcome_ok(fx, result.accepted, failure.guard if failure else None)
        all_ok &= ok
        _print_result(result, path)
        why = failure.summary if failure else "every guard passed"
        console.print(f"  => {'[green]as expected[/]' if ok else '[red]NOT as expected[/]'}: {escape(why)}")
        tally["as expected" if ok else "NOT as expected"] += 1
    console.print(f"{task_id}: {len(fixtures)} fixture(s) in {time.monotonic() - t0:.0f} s: "
                  + ", ".join(f"{n} {k}" for k, n in tally.items()), markup=False)
    return all_ok


@app.command()
def demo(
    task_id: str = typer.Option("k3_moe_dispatch", "--task", help="Task whose fixtures to judge."),
    bad: str = typer.Option("correctness-wrong-at-batch-33", help="The bad fixture judged after the good one."),
    device: str = typer.Option("cpu", help="cpu, cuda or auto."),
    repo: Path | None = typer.Option(None, help="The workbench checkout."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
) -> None:
    """The main job on the embedded default: judge the task's good fixture and one bad fixture."""
    _verbosity(verbose)
    from workbench.fixtures import list_fixtures
    from workbench.taskspec import load_task

    try:
        root = _root(repo)
        goods = [f.name for f in list_fixtures(load_task(root, task_id)) if f.good]
        ok = _judge_fixtures(root, task_id, goods + [bad], device, None)
    except (WorkbenchError, ValueError) as exc:
        _fail(exc)
    console.rule()
    console.print("[green]demo: every fixture judged as expected[/]" if ok else "[red]demo: a fixture was misjudged[/]")
    raise typer.Exit(0 if ok else 1)


@app.command()
def selftest(
    task_id: str = typer.Argument(..., help="Task id."),
    fixture: list[str] | None = typer.Option(None, "--fixture", "-f", help="Only these fixtures (repeatable)."),
    device: str = typer.Option("cpu", help="cpu, cuda or auto."),
    repo: Path | None = typer.Option(None, help="The workbench checkout."),
    base: str | None = typer.Option(None, help="Base commit the fixtures are judged against (default HEAD; an "
                                               "older one when a merge since makes a .patch fixture not apply)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
) -> None:
    """Judge every fixture of a task: good ones must be accepted, bad ones rejected by the guard their name says."""
    _verbosity(verbose)
    try:
        ok = _judge_fixtures(_root(repo), task_id, fixture, device, None, base)
    except (WorkbenchError, ValueError) as exc:
        _fail(exc)
    raise typer.Exit(0 if ok else 1)


@app.command()
def check(
    task_id: str = typer.Argument(..., help="Task id."),
    base: str | None = typer.Option(None, help="Base commit the candidate is judged against (the brief gives it; default HEAD)."),
    device: str = typer.Option("cpu", help="cpu, cuda or auto."),
    no_perf: bool = typer.Option(False, "--no-perf", help="Skip the perf estimate."),
    full: bool = typer.Option(False, "--full", help="Every public seed, the model eval and the task's perf "
                              "repetitions (minutes); default: quick (first public seed, no model eval, short perf)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help=VERBOSE_HELP),
) -> None:
    """Self-check the worktree you are in with the judge's own guards (public seeds), committed or not.

    Your files are judged as they are (committed, staged or untracked; nothing is committed for you).
    Never uses a run-time seed or random draws; the judging run does. Exit 0 when it passes, 1 when not.
    """
    _verbosity(verbose)
    from workbench.agents.selfcheck import self_check
    from workbench.pipeline import detect_device
    from workbench.taskspec import load_task
    from workbench.worktree import open_repo

    try:
        repo = open_repo(Path.cwd())
        wt = Path(repo.working_dir)
        task = load_task(wt, task_id)
        try:
            base_sha = repo.commit(base or "HEAD").hexsha
        except Exception:
            raise WorkbenchError(f"--base {base!r} is not a commit of {wt}; copy it from the brief.") from None
        with _judging():
            report = self_check(wt, task, base=base_sha, device=detect_device(device), with_perf=not no_perf,
                                full=full)
    except (WorkbenchError, ValueError) as exc:
        _fail(exc)
    console.print(report.text(), markup=False)
    raise typer.Exit(0 if report.ok else 1)


@app.command()
def bench(
    task_id: str = typer.Argument(..., help="Task id."),
    candidate: str | None = typer.Option(None, "--candidate", "-c", help="Overlay folder, patch or branch with the kernel."),
    device: str = typer.Option("cuda", help="cuda (the benchmark times GPU kernels)."),
    batch: list[int] | None = typer.Option(None, "--batch", help="Batch sizes (repeatable; default 1 2 4 8 16 32 64)."),
    out: Path | None = typer.Option(None, help="Output folder (default bench/results/local)."),
    repetitions: int = typer.Option(200, help="Timed calls per side and pair."),
    no_compile: bool = typer.Option(False, "--no-compile", help="Skip torch.compile of the standard path."),
    world_size: list[int] | None = typer.Option(None, "--world-size", help="Distributed tasks: TP sizes to "
        "sweep (repeatable; default the task's sizes above 1 that fit the GPUs)."),
    repo: Path | None = typer.Option(None, help="The workbench checkout."),
) -> None:
    """Benchmark the standard path (eager, CUDA graph, torch.compile) against a kernel over decode batches."""
    from workbench.bench import DEFAULT_BATCHES, run_bench

    try:
        path = run_bench(_root(repo), task_id, candidate=candidate, device=device, batches=batch or DEFAULT_BATCHES,
                         repetitions=repetitions, compile_standard=not no_compile, out_dir=out,
                         world_sizes=world_size)
    except (WorkbenchError, ValueError, RuntimeError) as exc:
        _fail(exc)
    console.print(str(path), markup=False)


def _int_list(command: str, opt: str, text: str | None) -> list[int] | None:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (None stays None); ``command`` names the command in the error.

    Raises:
        WorkbenchError: an item is not an integer.
    """
    if text is None:
        return None
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise WorkbenchError(f"workbench {command}: {opt} {text!r}: expected comma-separated integers, "
                             f"e.g. {opt} 1,2,4.") from None


@app.command("bench-model")
def bench_model(
    candidate: str | None = typer.Option(None, "--candidate", "-c", help="Overlay folder, patch or branch whose kernels "
                                         "the latency_specialized side uses (committed into a worktree as `bench` does)."),
    task: str = typer.Option("k3_moe_dispatch", "--task", help="The candidate's task (names its worktree; its op must "
                             "be one K3-mini calls)."),
    device: str = typer.Option("cuda", "--device", help="cuda (decode steps as CUDA graphs) or cpu (eager)."),
    batches: str | None = typer.Option(None, "--batches", help="Decode batches, comma-separated (default 1,2,4,8,16,32,64)."),
    contexts: str | None = typer.Option(None, "--contexts", help="Context lengths in tokens, comma-separated (default "
                                        "cuda 128,1024,8192,32768; cpu 32,128)."),
    chunk: int | None = typer.Option(None, "--chunk", help="Prompt chunk in tokens: prefill forward size, and what a "
                                     "mixed step's prefilling sequence runs (default cuda 128, cpu 32)."),
    steps: int | None = typer.Option(None, "--steps", help="Decode steps timed per side and configuration (default cuda 50, cpu 8)."),
    mixed_steps: int | None = typer.Option(None, "--mixed-steps", help="Mixed steps timed per side and configuration "
                                           "(eager; default cuda 5, cpu 2)."),
    profile_steps: int | None = typer.Option(None, "--profile-steps", help="Eager decode steps profiled per side and "
                                             "configuration (default 3; 0: none)."),
    backends: str = typer.Option("standard,latency_specialized", "--backends", help="Decode backends to time, comma-separated."),
    dtype: str | None = typer.Option(None, "--dtype", help="float32 or bfloat16 (default cuda bfloat16, cpu float32)."),
    seed: int = typer.Option(0, "--seed", help="K3-mini weight seed."),
    draft_tokens: int = typer.Option(7, "--draft-tokens", help="Speculative steps: drafts per request (DSpark: 7; 0: no "
                                     "speculative steps)."),
    acceptance_length: int = typer.Option(6, "--acceptance-length", help="Speculative steps: tokens each request emits "
                                          "per step (synthetic: its first AL - 1 drafts are right)."),
    out_dir: Path | None = typer.Option(None, "--out-dir", help="Output folder (default bench/results/local)."),
    timeout_s: float = typer.Option(1800.0, "--timeout-s", help="Wall-clock limit of the measuring child (seconds)."),
    repo: RepoOpt = None,
    verbose: VerboseOpt = False,
) -> None:
    """K3-mini end to end: decode_backend standard vs latency_specialized; decode, mixed and speculative
    verification steps (D drafts, synthetic acceptance length), batch x context.

    Writes k3_mini_bench_model.json (every step time, medians with 99% intervals, tokens/s, speedups, the
    dispatcher's decisions, a torch.profiler breakdown, the environment), .png and .log to --out-dir.
    """
    _verbosity(verbose)
    from guards import progress
    from workbench.bench_model import BenchModelSpec, read_result, run_bench_model, summary_rows
    from workbench.progress_view import showing_progress

    try:
        spec = BenchModelSpec.resolve(device=device, batches=_int_list("bench-model", "--batches", batches),
                                      contexts=_int_list("bench-model", "--contexts", contexts), chunk=chunk, steps=steps,
                                      mixed_steps=mixed_steps, profile_steps=profile_steps,
                                      backends=[b for b in backends.replace(" ", "").split(",") if b], dtype=dtype,
                                      seed=seed, candidate=candidate, task_id=task, draft_tokens=draft_tokens,
                                      acceptance_length=acceptance_length)
        root = _root(repo)
        with showing_progress(err):
            progress.guard_started("bench-model", 1, 1)
            path = run_bench_model(root, spec, out_dir=out_dir, timeout_s=timeout_s,
                                   log=lambda line: err.print(line, markup=False, highlight=False))
    except KeyboardInterrupt:
        err.print("[yellow]Interrupted: the measuring child was stopped; no result was written.[/]")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (WorkbenchError, ValueError, RuntimeError) as exc:
        _fail(exc)
    result = read_result(path)
    rows = summary_rows(result)
    t = Table(title=escape(f"K3-mini bench-model on {result.environment.get('gpu_name') or result.spec.device}, "
                           f"{result.spec.dtype} (decode: {result.rows[0].decode.mode}; mixed: eager)"))
    for col in rows[0]:
        t.add_column(escape(col))
    for r in rows:
        t.add_row(*(escape(v) for v in r.values()))
    console.print(t)
    for suffix in (".json", ".png", ".log"):
        console.print(str(path.with_suffix(suffix)), markup=False)


from workbench.review.cli import review_app, ui  # noqa: E402  (the review queue; light imports only)

app.add_typer(review_app, name="review")
app.command()(ui)


pool_app = typer.Typer(no_args_is_help=True, help="The pool that judges verdicts (--pool, --parallel): its progress.")
app.add_typer(pool_app, name="pool")


@pool_app.command("status")
def pool_status(
    repo: RepoOpt = None,
    runs: int = typer.Option(5, "--runs", help="Newest runs shown (count)."),
) -> None:
    """Each verdict of the newest pool runs: queued, running (node, worker pid, try), done or error.

    Reads .workbench/pool/*.json, which every run with --parallel or --pool ray:// keeps up to
    date; the review UI's /pool page shows the same.
    """
    from workbench.pool import read_boards

    boards = read_boards(_root(repo))[:max(runs, 0)]
    if not boards:
        console.print("no pool has judged here yet (workbench agent ... --parallel N, or --pool ray://HOST:PORT)",
                      markup=False)
        return
    for b in boards:
        t = Table(title=escape(f"{b.get('pool')} · run on {b.get('host')} (pid {b.get('pid')}) · updated "
                               f"{b.get('updated_at')}"))
        for col in ("verdict", "state", "node", "pid", "tries", "last change", "note"):
            t.add_column(col)
        counts: dict[str, int] = {}
        for label, e in sorted(b.get("verdicts", {}).items()):
            counts[e["state"]] = counts.get(e["state"], 0) + 1
            t.add_row(*(escape(str(x)) for x in (label, e["state"], e["node"], e["pid"] or "", e["tries"],
                                                  e["updated_at"], e["note"])))
        console.print(t)
        console.print(", ".join(f"{n} {state}" for state, n in counts.items()), markup=False)


model_app = typer.Typer(no_args_is_help=True, help="The K3 model: generate a K3-mini checkpoint.")
app.add_typer(model_app, name="model")


@model_app.command("generate")
def model_generate(
    out: Path = typer.Option(..., "--out", help="Checkpoint folder to write (config.json, model.safetensors, tokenizer)."),
    config: str = typer.Option("k3_mini", "--config", help="Named config (k3_mini)."),
    seed: int = typer.Option(0, help="Weight seed (same seed, same bytes)."),
) -> None:
    """Write random K3-mini weights (fixed seed) as safetensors with config.json and a locally trained tokenizer."""
    from k3_model.generate import write_checkpoint

    try:
        for p in write_checkpoint(out, config=config, seed=seed):
            console.print(str(p), markup=False)
    except ValueError as exc:
        _fail(exc)


def main() -> None:  # pragma: no cover - console entry for python -m
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
