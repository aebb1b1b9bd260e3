"""Judge one candidate: worktree, guards in order (cheap first, first FAIL stops), result file.

Source: DESIGN.md "The flow of one candidate".
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import shlex
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from guards import progress
from guards.artifacts import view_for
from guards.base import Guard, GuardContext
from guards.judged_tree import judged_tree
from guards.verdict import Evidence, Status, Verdict
from workbench import env as envmod
from workbench.errors import Interrupted
from workbench.results import (
    CandidateInfo,
    CaseResult,
    PerfResult,
    RunResult,
    file_sha256,
    now_utc,
    perf_was_judged,
    write_result,
)
from workbench.taskspec import TaskSpec, check_target, load_task
from workbench.worktree import Candidate, create_candidate, open_repo, state_dir

if TYPE_CHECKING:
    from workbench.pool import Pool

logger = logging.getLogger("workbench.pipeline")


def default_guards() -> list[Guard]:
    """The pipeline's guards, cheapest first."""
    from guards.activation import ActivationGuard
    from guards.audit import AuditGuard
    from guards.correctness import CorrectnessGuard
    from guards.isolation import IsolationGuard
    from guards.model_eval import ModelEvalGuard
    from guards.perf import PerfGuard

    return [IsolationGuard(), AuditGuard(), CorrectnessGuard(), ActivationGuard(), ModelEvalGuard(), PerfGuard()]


def run_guards(ctx: GuardContext, guards: Sequence[Guard]) -> list[Verdict]:
    """Run guards in order; the first FAIL or ERROR stops the run, later guards are SKIP.

    A guard that raises is recorded as ERROR with the exception text (the guard broke, not the candidate).
    Every child that runs candidate code imports it from a plain clone of the candidate commit made
    here (:func:`guards.judged_tree.judged_tree`), unless ``ctx.judged_tree`` names one already.

    Raises:
        RuntimeError: the judged tree could not be made (git's reason in the message).
    """
    with contextlib.ExitStack() as stack:
        if ctx.judged_tree is None:  # the children import from a plain clone, not the worktree (guards.judged_tree)
            ctx = dataclasses.replace(ctx, judged_tree=stack.enter_context(
                judged_tree(ctx.worktree, ctx.candidate_commit, Path(ctx.repo_root).resolve().name)))
        return _run_guards(ctx, guards)


def _run_guards(ctx: GuardContext, guards: Sequence[Guard]) -> list[Verdict]:
    verdicts: list[Verdict] = []
    stopped_by: str | None = None
    for i, g in enumerate(guards, 1):
        if stopped_by:
            verdicts.append(Verdict(guard=g.name, status=Status.SKIP, summary=f"Not run: {stopped_by} did not pass."))
            continue
        t0 = time.monotonic()
        progress.guard_started(g.name, i, len(guards))
        try:
            v = g.check(dataclasses.replace(ctx, artifacts=view_for(ctx.artifacts, g)))
        except Exception as exc:
            logger.debug("guard %s raised", g.name, exc_info=True)
            tb = "".join(traceback.format_exception(exc, limit=-6))[-3000:]
            v = Verdict(guard=g.name, status=Status.ERROR,
                        summary=f"The guard itself failed: {type(exc).__name__}: {exc}",
                        evidence=(Evidence(name="exception", value=f"{type(exc).__name__}: {exc}"),
                                  Evidence(name="traceback", value=tb)))
        v = v.with_duration(time.monotonic() - t0)
        progress.guard_finished(g.name, v.status.value, time.monotonic() - t0, v.summary)
        verdicts.append(v)
        if v.status in (Status.FAIL, Status.ERROR):
            stopped_by = g.name
    return verdicts


def is_accepted(verdicts: Sequence[Verdict]) -> bool:
    """Accepted: no FAIL or ERROR, and the activation guard PASSed (proof the new path ran).

    This is "the guards found nothing wrong", not "a speedup was measured": where the perf guard SKIPs
    (the task judges performance on other devices only, or no timed workload lies in the declared
    scope) the result is accepted with ``perf_judged`` false, which the result file, report, CLI and
    review queue show as "correct, perf not judged" (``RunResult.acceptance``), never as a plain accept.
    """
    if any(v.status in (Status.FAIL, Status.ERROR) for v in verdicts):
        return False
    return any(v.guard == "activation" and v.status is Status.PASS for v in verdicts)


def detect_device(requested: str | None) -> str:
    """``cuda`` when requested or available, else ``cpu``.

    Raises:
        ValueError: ``cuda`` requested but unavailable, or an unknown device.
    """
    import torch

    if requested in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested not in ("cpu", "cuda"):
        raise ValueError(f"--device {requested!r}: expected cpu, cuda or auto.")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible; use --device cpu or run on a GPU machine.")
    return requested


def draw_runtime_seed(task: TaskSpec) -> int:
    """A fresh 31-bit run-time seed, never one of the task's public seeds (those are for self-checks)."""
    public = set(task.correctness.public_seeds)
    while True:
        seed = secrets.randbits(31)
        if seed not in public:
            return seed


@dataclasses.dataclass
class GuardsPhase:
    """What the guards of one judging hand to the result file: the first phase of :func:`judge_candidate`,
    run in this process or in a pool's worker (``workbench.pool``), plain data that pickles.

    Attributes:
        verdicts: in pipeline order.
        changed_paths: the isolation guard's list (repo-relative).
        cases: the correctness guard's per-configuration dicts.
        perf: the perf guard's per-configuration dicts.
        trace: the dispatch decisions recorded while the candidate ran (at most 2000).
        environment: :func:`workbench.env.collect` on the machine that judged.
    """

    verdicts: list[Verdict]
    changed_paths: list[str]
    cases: list[dict]
    perf: list[dict]
    trace: list[dict]
    environment: dict


def run_guards_phase(repo_root: Path, task: TaskSpec, cand: Candidate, *, device: str, seed: int,
                     guards: Sequence[Guard]) -> GuardsPhase:
    """Run ``guards`` on a committed candidate (:func:`run_guards`) and collect what the result file needs.

    Raises:
        RuntimeError: the judged tree could not be made (git's reason in the message).
    """
    from workbench.heap import give_back_freed_memory, keep_freed_memory

    keep_freed_memory()  # the guards' large tensors are reused, not re-faulted (workbench/heap.py)
    from guards.sandbox import warm_zygote

    warm_zygote(device)
    ctx = GuardContext(task=task, repo_root=Path(repo_root), worktree=cand.worktree, base_commit=cand.base_commit,
                       candidate_commit=cand.candidate_commit, device=device, seed=seed)
    try:
        verdicts = run_guards(ctx, guards)
    finally:
        give_back_freed_memory()  # a long-lived judging process does not keep its largest judgment's heap
    trace: list[dict] = []
    for calls in (ctx.artifacts.traces or {}).values():
        for call in calls:
            trace.extend(call)
    return GuardsPhase(verdicts=verdicts, changed_paths=list(ctx.artifacts.changed_paths or ()),
                       cases=list(ctx.artifacts.cases or []), perf=list(ctx.artifacts.perf or []),
                       trace=trace[:2000], environment=envmod.collect(device))


def judge_candidate(
    repo_root: Path,
    task: TaskSpec,
    cand: Candidate,
    *,
    device: str,
    seed: int | None = None,
    guards: Sequence[Guard] | None = None,
    command: str = "",
    agent: str = "patch",
    transcript_path: str | None = None,
    attempt: int | None = None,
    pool: Pool | None = None,
) -> tuple[RunResult, Path]:
    """Run the guards on a committed candidate and write its result file.

    Two phases: the guards (:func:`run_guards_phase`, here or in ``pool``'s worker), then, always here,
    the pooling with earlier judgings of the same content, the result file and the judgings ledger, so
    each judging writes exactly one result file wherever its guards ran.

    Args:
        seed: the run-time seed; ``None`` draws one (:func:`draw_runtime_seed`). Either way it is the
            result's ``seed`` and part of the default reproduce command.
        command: the reproduce command to record; it must name ``--seed`` (callers build it with the
            seed they pass). Default: a ``workbench verify`` command with the seed.
        attempt: for agent runs, the 1-based attempt number; it becomes part of the result id
            (``<task>-<n>-a<attempt>-<sha8>``) so an attempt that changed nothing keeps its own file.
        pool: where the guards run (``workbench.pool``; ``None``: in this process, today's behaviour). A
            pool whose worker died or refused the task returns an ERROR verdict of guard ``pool``.

    Returns:
        ``(result, path_to_json)``.
    """
    started = now_utc()
    t0 = time.monotonic()
    seed = draw_runtime_seed(task) if seed is None else seed
    guards = default_guards() if guards is None else list(guards)
    tag = f"-a{attempt}" if attempt is not None else ""
    result_id = f"{task.task_id}-{cand.branch.rsplit('/', 1)[-1]}{tag}-{cand.candidate_commit[:8]}"
    if pool is None:
        phase = run_guards_phase(repo_root, task, cand, device=device, seed=seed, guards=guards)
    else:
        phase = pool.run_guards(repo_root, task, cand, device=device, seed=seed, guards=guards, label=result_id)
    from workbench import retries

    key = retries.content_key(cand.worktree, task, cand.base_commit, cand.candidate_commit, device,
                              tuple(g.name for g in guards))
    pooled = retries.pool(task, phase.verdicts, phase.perf,
                          retries.earlier_judgings(state_dir(repo_root), key), device=device, seed=seed)
    if pooled.judging > 1:
        logger.info("judging %d of content %s: pooled with %s", pooled.judging, key[:12], ", ".join(pooled.pooled_from))
    verdicts = pooled.verdicts
    result = RunResult(
        result_id=result_id,
        task_id=task.task_id,
        task_spec_sha256=file_sha256(Path(task.root) / "task.toml"),
        candidate=CandidateInfo(source=cand.source, kind=cand.kind, branch=cand.branch, worktree=str(cand.worktree),
                                base_commit=cand.base_commit, candidate_commit=cand.candidate_commit,
                                changed_paths=tuple(phase.changed_paths), agent=agent,
                                transcript_path=transcript_path, set_aside=cand.set_aside,
                                target_base=cand.target_base),
        environment=phase.environment,
        device=device,
        verdicts=tuple(verdicts),
        accepted=is_accepted(verdicts),
        content_key=key,
        judging=pooled.judging,
        pooled_from=tuple(pooled.pooled_from),
        perf_judged=perf_was_judged(verdicts),
        seed=seed,
        cases=tuple(CaseResult(**c) for c in phase.cases),
        perf=tuple(PerfResult(**p) for p in pooled.perf),
        dispatch_trace=tuple(phase.trace),
        command=_env_prefix() + (command or f"workbench verify {task.task_id} --branch {cand.branch} "
                                            f"--base {cand.base_commit[:12]} --device {device} --seed {seed}"),
        started_at=started,
        duration_s=round(time.monotonic() - t0, 3),
    )
    path = write_result(result, state_dir(repo_root) / "results")
    _log_dispatch(result.dispatch_trace)
    first = result.first_failure()
    retries.record_judging(state_dir(repo_root), retries.Judging(
        key=key, result_id=result.result_id, result_path=str(path), accepted=result.accepted,
        failed_guard=first.guard if first else ""))
    return result, path


def _log_dispatch(trace: Sequence[dict]) -> None:
    """``-v``: the dispatch decisions the guards' children recorded (the result's ``dispatch_trace``), one debug
    line per distinct (op, implementation, phase, reason) with its count."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    from collections import Counter

    counts = Counter((d.get("op"), d.get("implementation"), d.get("phase"), d.get("reason")) for d in trace)
    for (op, impl, phase, reason), n in counts.most_common():
        logger.debug("dispatch: %s -> %s x%d (phase %s): %s", op, impl, n, phase, reason)


def _env_prefix() -> str:
    """``VAR=value `` for each ``WORKBENCH_MODEL_EVAL_*`` setting in effect (so the reproduce command
    reproduces the model eval's lengths and its vLLM leg; ``--model-eval-vllm`` sets one)."""
    from workbench import envs

    return "".join(f"{k}={shlex.quote(v)} " for k, v in envs.model_eval_overrides().items())


def run_candidate(repo_root: Path, task_id: str, source: str, *, base: str | None = None, device: str | None = None,
                  seed: int | None = None, pool: Pool | None = None) -> tuple[RunResult, Path]:
    """``workbench run TASK --candidate SOURCE``: worktree, commit, guards (here or in ``pool``), result file.

    Without ``seed`` a fresh run-time seed is drawn; the result records it (``seed``) and its reproduce
    command always carries ``--seed N``.
    """
    repo = open_repo(Path(repo_root))
    root = Path(repo.working_dir)
    task = load_task(root, task_id)
    check_target(root, task)  # the task's own mistake, before any candidate is blamed for it (exit 2)
    dev = detect_device(device) if pool is None else pool.detect_device(device)
    seed = draw_runtime_seed(task) if seed is None else seed  # drawn here, so the command below names it
    cand = create_candidate(root, task_id, source, base)  # cleans up after itself when stopped
    try:  # from here a Ctrl-C (or SIGTERM) removes the worktree and branch: interrupted()
        if cand.set_aside:
            logger.warning("%s: %s; the result is not queued for review", task_id, cand.set_aside)
        shown = str(Path(source).resolve()) if Path(source).exists() else str(source)  # a path works from any cwd
        cmd = (f"workbench run {task_id} --candidate {shlex.quote(shown)} --base {cand.target_base[:12]} "
               f"--device {dev} --seed {seed}")
        return judge_candidate(root, task, cand, device=dev, seed=seed, command=cmd, pool=pool)
    except KeyboardInterrupt as exc:
        raise interrupted(root, cand) from exc


def interrupted(root: Path, cand: Candidate) -> Interrupted:
    """Ctrl-C while ``cand`` was judged: kill every child, remove its worktree and branch (the candidate's
    source, a patch, folder or branch of the user's, is untouched), and say what was interrupted."""
    from guards.sandbox import kill_all_children
    from workbench.worktree import remove_candidate

    step = progress.current()
    groups = kill_all_children()
    remove_candidate(root, cand.worktree, cand.branch)
    where = f"{step.guard} ({step.phase})" if step.guard else "setting up"
    return Interrupted(f"Interrupted during {where}: stopped {groups} child process group(s), removed worktree "
                       f"{cand.worktree} and branch {cand.branch}; no result file was written. Run the same "
                       "command again to judge it.")
