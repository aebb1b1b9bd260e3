"""The ``workbench`` command line.

Exit codes of ``run`` and ``verify``: 0 accepted, 1 rejected, 2 bad input or infrastructure error;
the last line printed is the result file's path. No torch import at module level (fast ``--help``).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from workbench.errors import WorkbenchError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="kernel-workbench: judge kernel candidates for K3 with guards, keep the evidence.")
console = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)

EXIT_ACCEPTED, EXIT_REJECTED, EXIT_ERROR = 0, 1, 2
STATUS_STYLE = {"PASS": "green", "FAIL": "red", "ERROR": "magenta", "SKIP": "dim"}


def _root(repo: Optional[Path]) -> Path:
    from workbench.worktree import open_repo

    try:
        return Path(open_repo(repo or Path.cwd()).working_dir)
    except WorkbenchError as exc:
        _fail(exc)
        raise  # unreachable: _fail exits


def _print_result(result, path: Path) -> None:
    verdict = "[green]ACCEPTED[/]" if result.accepted else "[red]REJECTED[/]"
    console.print(f"{result.task_id} candidate {result.candidate.source}: {verdict}")
    for v in result.verdicts:
        style = STATUS_STYLE[v.status.value]
        console.print(f"  {v.guard:<12} [{style}]{v.status.value:<5}[/] {v.summary}")
    console.print(str(path))


def _exit_code(result) -> int:
    """0 accepted, 2 when a guard broke (ERROR: the verdict is not a judgement), else 1."""
    if result.accepted:
        return EXIT_ACCEPTED
    return EXIT_ERROR if any(v.status.value == "ERROR" for v in result.verdicts) else EXIT_REJECTED


def _fail(exc: Exception) -> None:
    err.print(f"[red]error:[/] {exc}")
    raise typer.Exit(EXIT_ERROR)


@app.callback()
def _main(verbose: bool = typer.Option(False, "--verbose", "-v", help="Log every dispatch decision and guard step.")) -> None:
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, format="%(name)s: %(message)s")


@app.command()
def run(
    task_id: str = typer.Argument(..., help="Task id (a folder under tasks/)."),
    candidate: str = typer.Option(..., "--candidate", "-c", help="A .patch file, an overlay folder, or a branch."),
    base: Optional[str] = typer.Option(None, help="Base revision (default HEAD; for a branch, its merge-base)."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    seed: Optional[int] = typer.Option(None, help="Run-time seed (default: random, recorded in the result)."),
    repo: Optional[Path] = typer.Option(None, help="The workbench checkout (default: the repo around the cwd)."),
    no_queue: bool = typer.Option(False, "--no-queue", help="Do not put an accepted candidate in the review queue."),
) -> None:
    """Judge a candidate: worktree from the base, apply, commit, run every guard, write the result file."""
    from workbench.pipeline import run_candidate

    try:
        result, path = run_candidate(_root(repo), task_id, candidate, base=base, device=device, seed=seed)
    except (WorkbenchError, ValueError) as exc:
        _fail(exc)
    if not no_queue:
        from workbench.review.cli import enqueue_accepted

        enqueue_accepted(_root(repo), result, path)
    _print_result(result, path)
    raise typer.Exit(_exit_code(result))


@app.command()
def verify(
    task_id: str = typer.Argument(..., help="Task id."),
    branch: str = typer.Option(..., "--branch", "-b", help="Branch (or commit) holding the candidate."),
    base: Optional[str] = typer.Option(None, help="Base revision (default: merge-base with HEAD)."),
    device: str = typer.Option("auto", help="cpu, cuda or auto."),
    seed: Optional[int] = typer.Option(None, help="Run-time seed."),
    repo: Optional[Path] = typer.Option(None, help="The workbench checkout."),
    no_queue: bool = typer.Option(False, "--no-queue", help="Do not put an accepted candidate in the review queue."),
) -> None:
    """Re-run every guard on an existing branch (e.g. on your own GPU) and write a new result file."""
    from workbench.pipeline import run_candidate

    try:
        result, path = run_candidate(_root(repo), task_id, branch, base=base, device=device, seed=seed)
    except (WorkbenchError, ValueError) as exc:
        _fail(exc)
    if not no_queue:
        from workbench.review.cli import enqueue_accepted

        enqueue_accepted(_root(repo), result, path)
    _print_result(result, path)
    raise typer.Exit(_exit_code(result))


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
    t = Table(title=f"{ra.task_id}: {a.name} vs {b.name}")
    for col in ("config", "A speedup", "B speedup", "A verdict", "B verdict"):
        t.add_column(col)
    pb = {p.name: p for p in rb.perf}
    for p in ra.perf:
        q = pb.get(p.name)
        t.add_row(p.name, f"{p.speedup:.3f}x", f"{q.speedup:.3f}x" if q else "-", p.verdict, q.verdict if q else "-")
    console.print(t)
    console.print(f"A: {'accepted' if ra.accepted else 'rejected'} on {ra.device} {ra.environment.get('gpu_name') or ''}; "
                  f"B: {'accepted' if rb.accepted else 'rejected'} on {rb.device} {rb.environment.get('gpu_name') or ''}")


@app.command()
def tasks(repo: Optional[Path] = typer.Option(None, help="The workbench checkout.")) -> None:
    """List the tasks and their allowed paths."""
    from workbench.taskspec import list_task_ids, load_task

    root = _root(repo)
    t = Table(title="tasks")
    for col in ("task", "op", "target", "allowed paths", "workloads"):
        t.add_column(col)
    for tid in list_task_ids(root):
        try:
            s = load_task(root, tid)
        except WorkbenchError as exc:
            t.add_row(tid, "[red]invalid[/]", str(exc)[:80], "", "")
            continue
        t.add_row(tid, s.op, s.target, ", ".join(s.allowed_paths), str(len(s.correctness.workloads)))
    console.print(t)


def _judge_fixtures(root: Path, task_id: str, names: Optional[list[str]], device: str, seed: Optional[int]) -> bool:
    from workbench.fixtures import fixture_outcome_ok, list_fixtures
    from workbench.pipeline import run_candidate
    from workbench.taskspec import load_task

    spec = load_task(root, task_id)
    fixtures = list_fixtures(spec)
    if names:
        unknown = sorted(set(names) - {f.name for f in fixtures})
        if unknown:
            raise WorkbenchError(f"Task {task_id!r} has no fixture {unknown[0]!r}; known: {', '.join(f.name for f in fixtures)}.")
        fixtures = [f for f in fixtures if f.name in names]
    all_ok = True
    for fx in fixtures:
        expect = "accepted" if fx.good else f"rejected by {fx.expected_guard}"
        console.rule(f"{'good' if fx.good else 'bad'} fixture {fx.name} (expected: {expect})")
        result, path = run_candidate(root, task_id, str(fx.path), device=device, seed=seed)
        failure = result.first_failure()
        ok = fixture_outcome_ok(fx, result.accepted, failure.guard if failure else None)
        all_ok &= ok
        _print_result(result, path)
        why = failure.summary if failure else "every guard passed"
        console.print(f"  => {'[green]as expected[/]' if ok else '[red]NOT as expected[/]'}: {why}")
    return all_ok


@app.command()
def demo(
    task_id: str = typer.Option("k3_moe_dispatch", "--task", help="Task whose fixtures to judge."),
    bad: str = typer.Option("correctness-wrong-at-batch-33", help="The bad fixture judged after the good one."),
    device: str = typer.Option("cpu", help="cpu, cuda or auto."),
    repo: Optional[Path] = typer.Option(None, help="The workbench checkout."),
) -> None:
    """The main job on the embedded default: judge the task's good fixture and one bad fixture."""
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
    fixture: Optional[list[str]] = typer.Option(None, "--fixture", "-f", help="Only these fixtures (repeatable)."),
    device: str = typer.Option("cpu", help="cpu, cuda or auto."),
    repo: Optional[Path] = typer.Option(None, help="The workbench checkout."),
) -> None:
    """Judge every fixture of a task: good ones must be accepted, bad ones rejected by the guard their name says."""
    try:
        ok = _judge_fixtures(_root(repo), task_id, fixture, device, None)
    except (WorkbenchError, ValueError) as exc:
        _fail(exc)
    raise typer.Exit(0 if ok else 1)


from workbench.review.cli import review_app, ui  # noqa: E402  (the review queue; light imports only)

app.add_typer(review_app, name="review")
app.command()(ui)


def main() -> None:  # pragma: no cover - console entry for python -m
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
