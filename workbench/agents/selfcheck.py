"""The self-check an agent runs on its own worktree, and the baseline numbers its brief quotes.

``workbench check TASK`` (and the anthropic backend's ``run_check`` tool) reuse the guards' own
machinery on the task's **public** seeds only: the paths changed against the base, correctness on
the fixed workloads (no random draws: those are drawn at judging time from a seed the agent never
sees), activation, and a short perf estimate. A PASS here is a hint, not a verdict: the run's guards
judge again with fresh inputs and more repetitions.

Source: issue 4 ("Brief": a public subset of the checks); guards/*.py for every check reused here.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import posixpath
import subprocess
import time
from pathlib import Path

from guards.verdict import Status, Verdict
from workbench.taskspec import TaskSpec

logger = logging.getLogger("workbench.agents.selfcheck")

QUICK_PERF_WARMUP = 5
"""Untimed calls per side before the quick perf estimate (calls)."""
QUICK_PERF_REPETITIONS = 30
"""Timed calls per side in the quick perf estimate (calls); the judging run uses the task's count."""


def public_task(task: TaskSpec, *, perf_warmup: int = QUICK_PERF_WARMUP,
                perf_repetitions: int = QUICK_PERF_REPETITIONS) -> TaskSpec:
    """A copy of ``task`` with no run-time random draws and a short perf run (for self-checks only)."""
    corr = task.correctness.model_copy(update={"random_draws": 0})
    perf = task.perf.model_copy(update={"warmup": perf_warmup, "repetitions": max(10, perf_repetitions)})
    return task.model_copy(update={"correctness": corr, "perf": perf})


@dataclasses.dataclass
class SelfCheckReport:
    """What a self-check found.

    Attributes:
        ok: paths, correctness and activation passed (the perf estimate is advisory, see
            :attr:`perf_warning`).
        verdicts: one per step (``paths``, ``correctness[seed=S]``, ``activation``, ``perf_estimate``).
        duration_s: wall time (seconds).
    """

    ok: bool
    verdicts: list[Verdict]
    duration_s: float

    @property
    def perf_warning(self) -> bool:
        """The quick perf estimate did not show the gain the judging run requires (advisory: few calls)."""
        return any(v.guard == "perf_estimate" and v.status is not Status.PASS for v in self.verdicts)

    def text(self, max_evidence: int = 6) -> str:
        """Plain-text report for the agent: one line per step, then the failing step's evidence."""
        head = "PASS" if self.ok else "FAIL"
        if self.ok and self.perf_warning:
            head = "PASS with a perf warning (the estimate uses few calls; the judging run times more)"
        lines = [f"self-check: {head} ({self.duration_s:.1f} s; public seeds only, "
                 "the judging run draws fresh inputs and random batch sizes)"]
        for v in self.verdicts:
            lines.append(f"  {v.guard:<22} {v.status.value:<5} {v.summary}")
        bad = next((v for v in self.verdicts if v.status in (Status.FAIL, Status.ERROR)), None)
        if bad is not None:
            lines.append(f"evidence of {bad.guard}:")
            for e in bad.evidence[:max_evidence]:
                where = f" [{e.path}]" if e.path else ""
                lines.append(f"  - {e.name}{where}: {str(e.value)[:400]}{(' ' + e.unit) if e.unit else ''}")
        return "\n".join(lines)


def _changed_paths(worktree: Path, base: str) -> list[str]:
    """Paths that differ between ``base`` and the worktree's files (committed, staged, unstaged, untracked)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(worktree), *args], capture_output=True, text=True, check=True,
                              stdin=subprocess.DEVNULL).stdout

    changed = set(git("diff", "--name-only", "--no-renames", base).split("\n"))
    changed |= set(git("ls-files", "--others", "--exclude-standard").split("\n"))
    return sorted(p for p in changed if p)


def check_paths(worktree: Path, task: TaskSpec, base: str) -> Verdict:
    """The isolation rule on the worktree's uncommitted state: every changed path allowed, no escaping symlink."""
    from guards.isolation import path_problem
    from guards.verdict import Evidence

    problems = []
    changed = _changed_paths(worktree, base)
    for p in changed:
        why = path_problem(p, task.allowed_paths, task.all_forbidden)
        full = worktree / p
        if why is None and full.is_symlink():
            target = os.readlink(full)
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(p), target))
            why = "absolute symlink" if target.startswith("/") else path_problem(resolved, task.allowed_paths, task.all_forbidden)
        if why:
            problems.append(Evidence(name="forbidden_path", value=why, path=p))
    if problems:
        return Verdict(guard="paths", status=Status.FAIL,
                       summary=f"{len(problems)} change(s) outside the allowed paths; first: {problems[0].path} ({problems[0].value}).",
                       evidence=tuple(problems[:20]))
    if not changed:
        return Verdict(guard="paths", status=Status.FAIL, summary="Nothing changed relative to the base commit yet.",
                       evidence=(Evidence(name="changed_paths", value=0, unit="count"),))
    return Verdict(guard="paths", status=Status.PASS,
                   summary=f"{len(changed)} changed path(s), all inside {', '.join(task.allowed_paths)}.")


def self_check(worktree: Path, task: TaskSpec, *, base: str, device: str = "cpu", with_perf: bool = True) -> SelfCheckReport:
    """Run the public self-check on a worktree's current files.

    Args:
        worktree: the agent's checkout (its ``k3_model`` runs in child processes only).
        task: the task spec.
        base: the base commit the candidate is judged against (paths are compared with it).
        device: ``cpu`` or ``cuda``.
        with_perf: add the quick perf estimate (seconds of extra time).

    Returns:
        The report; a failing step stops the later ones (the perf estimate runs only after
        correctness and activation pass).

    Raises:
        OSError: a child process cannot be started (infrastructure, not the candidate).
    """
    from guards.activation import ActivationGuard
    from guards.base import GuardContext
    from guards.correctness import CorrectnessGuard
    from guards.perf import PerfGuard

    t0 = time.monotonic()
    worktree = Path(worktree)
    ptask = public_task(task)
    verdicts = [check_paths(worktree, task, base)]
    logger.info("self-check %s: paths %s", worktree.name, verdicts[-1].status.value)
    first_ctx = None
    if verdicts[-1].status is Status.PASS:
        for seed in task.correctness.public_seeds:
            ctx = GuardContext(task=ptask, repo_root=worktree, worktree=worktree, base_commit=base,
                               candidate_commit="worktree", device=device, seed=seed)
            v = CorrectnessGuard().check(ctx)
            v = v.model_copy(update={"guard": f"correctness[seed={seed}]"})
            verdicts.append(v)
            logger.info("self-check %s: correctness seed %d %s", worktree.name, seed, v.status.value)
            first_ctx = first_ctx or ctx
            if v.status is not Status.PASS:
                break
    if first_ctx is not None and all(v.status is Status.PASS for v in verdicts):
        v = ActivationGuard().check(first_ctx)
        verdicts.append(v)
        if v.status is Status.PASS and with_perf:
            p = PerfGuard().check(first_ctx)
            verdicts.append(p.model_copy(update={
                "guard": "perf_estimate",
                "summary": f"(estimate, {ptask.perf.repetitions} calls per side) {p.summary}"}))
    ok = all(v.status is Status.PASS for v in verdicts if v.guard != "perf_estimate")
    return SelfCheckReport(ok=ok, verdicts=verdicts, duration_s=round(time.monotonic() - t0, 2))


def baseline_timings(worktree: Path, task: TaskSpec, *, device: str, repetitions: int = 20,
                     warmup: int = 5) -> dict[str, float]:
    """Median time of the standard path per perf workload, measured quickly on the first public seed.

    Both timed sides run the standard path (``decode_backend="standard"``), so the numbers are the
    baseline a candidate must beat; the base worktree is used, so no candidate code runs.

    Args:
        worktree: a checkout of the base commit.
        task: the task spec.
        device: ``cpu`` or ``cuda``.
        repetitions: timed calls per side (calls).
        warmup: untimed calls per side (calls).

    Returns:
        workload name -> median (microseconds); empty when the timing child failed, for distributed
        tasks, and where the task does not judge performance on ``device`` (logged).
    """
    from guards.cases import build_case
    from guards.sandbox import run_child
    from kernels.stats import median

    if task.distributed is not None or device not in task.perf.devices:
        # one process cannot time a collective; the perf guard times every rank (guards/perf.py)
        logger.info("no quick baseline for %s on %s (distributed task or perf not judged on this device)",
                    task.task_id, device)
        return {}
    seed = task.correctness.public_seeds[0] if task.correctness.public_seeds else 0
    cases = [build_case(task, task.workload(n), seed) for n in task.perf.workloads]
    request = {"mode": "perf", "target": task.target, "op": task.op, "device": device, "decode_backend": "standard",
               "cases": [c.request_entry() for c in cases], "perf": {"warmup": warmup, "repetitions": repetitions}}
    outcome = run_child(Path(worktree), request, timeout_s=task.timeouts.perf_s,
                        memory_bytes=task.timeouts.memory_bytes, device=device)
    if outcome.response is None or not outcome.response.get("ok"):
        logger.warning("baseline timing failed: %s", outcome.problem or outcome.response.get("error"))
        return {}
    out = {}
    for p in outcome.response.get("perf", []):
        samples = [float(x) for x in p["baseline_us"]] + [float(x) for x in p["candidate_us"]]
        out[p["name"]] = round(median(samples), 2)
    return out
