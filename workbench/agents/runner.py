"""The agent runner: one task to one agent backend, in its own worktree, attempt after attempt.

``run_agent`` creates branch ``wb/<task>/<n>`` and its worktree at the base, measures the baseline,
writes the brief to ``.workbench/briefs/<task>-<n>.md``, then for each attempt: writes the feedback
and prompt files, lets the backend change the worktree, commits whatever it left (hooks off, leftovers
cleaned), and judges that commit with the guards under a fresh run-time seed (never a public seed,
never shown to the agent before its verdict; the feedback's reproduce command names it
afterwards). After a rejection the next attempt gets the verdicts and evidence; the run
stops at the first accepted attempt, when the attempts are used up, or when the backend cannot revise.
Each attempt keeps its commit, result file (``<task>-<n>-a<k>-<sha8>.json``) and transcript
(``.workbench/transcripts/<task>-<n>-a<k>.jsonl``); the run record ``.workbench/runs/<task>-<n>.json``
lists them with tokens and cost. Several runs may go at once: each has its own worktree and branch,
and every git operation that touches shared state holds ``workbench.worktree.git_lock``.

Source: issue 4; DESIGN.md "The flow of one candidate".
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from guards.base import Guard
from workbench.agents.base import AgentBackend, AttemptContext, AttemptOutcome, TokenUsage
from workbench.agents.brief import render_brief, render_feedback
from workbench.errors import Interrupted
from workbench.results import RunResult, now_utc
from workbench.worktree import AgentWorktree, Candidate, commit_attempt, create_agent_worktree, open_repo, state_dir

if TYPE_CHECKING:
    from workbench.pool import Pool

logger = logging.getLogger("workbench.agents.runner")


@dataclasses.dataclass
class AttemptRecord:
    """One attempt, as the run record keeps it.

    Attributes:
        attempt: 1-based number.
        commit: the judged commit.
        changed: the agent changed files in this attempt.
        accepted: the guards accepted the commit.
        first_failure: ``guard: summary`` of the deciding verdict (empty when accepted).
        result_path: the result file.
        transcript_path: the backend's transcript.
        feedback_path: the feedback file this attempt started from (attempt 1: none).
        outcome: the backend's own report (stop reason, submitted, usage, note, duration).
    """

    attempt: int
    commit: str
    changed: bool
    accepted: bool
    first_failure: str
    result_path: str
    transcript_path: str
    feedback_path: str | None
    outcome: dict[str, Any]


@dataclasses.dataclass
class AgentRunResult:
    """A whole agent run.

    Attributes:
        task_id, agent: the task and the backend's label.
        branch, worktree, base_commit: where the attempts were committed.
        brief_path, record_path: the brief and the run record (JSON).
        attempts: one record per attempt, in order.
        final: the last attempt's result (``None`` if no attempt was judged).
        final_path: its result file.
        usage: tokens and cost over all attempts.
    """

    task_id: str
    agent: str
    branch: str
    worktree: Path
    base_commit: str
    brief_path: Path
    record_path: Path
    attempts: list[AttemptRecord]
    final: RunResult | None
    final_path: Path | None
    usage: TokenUsage

    @property
    def accepted(self) -> bool:
        """Whether the last judged attempt was accepted."""
        return bool(self.final and self.final.accepted)


def _write_record(run: AgentRunResult, status: str) -> None:
    data = {
        "record_version": 1, "status": status, "updated_at": now_utc(), "task_id": run.task_id, "agent": run.agent,
        "branch": run.branch, "worktree": str(run.worktree), "base_commit": run.base_commit,
        "brief_path": str(run.brief_path), "accepted": run.accepted,
        "final_result": str(run.final_path) if run.final_path else None,
        "usage": run.usage.to_dict(), "attempts": [dataclasses.asdict(a) for a in run.attempts],
    }
    run.record_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = run.record_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
    tmp.replace(run.record_path)


def run_agent(
    repo_root: Path,
    task_id: str,
    backend: AgentBackend,
    *,
    attempts: int = 1,
    base: str | None = None,
    device: str | None = None,
    guards: Sequence[Guard] | None = None,
    measure_baseline: bool = True,
    seeds: Sequence[int] | None = None,
    pool: Pool | None = None,
) -> AgentRunResult:
    """Run attempts of ``backend`` on ``task_id`` until one is accepted or ``attempts`` are used.

    Args:
        repo_root: the workbench's checkout.
        task_id: the task.
        backend: the agent backend.
        attempts: attempts allowed (count, >= 1).
        base: base revision (default HEAD).
        device: ``cpu``, ``cuda`` or ``auto``/``None``.
        guards: the guards to judge with (default: the pipeline's).
        measure_baseline: time the standard path for the brief (a few seconds).
        seeds: run-time seeds per attempt (tests only; default: fresh, never a public seed).
        pool: where each attempt's verdict is judged (``workbench.pool``; ``None``: in this process). The
            loop waits for each verdict before the next attempt, so its feedback is unchanged; with a
            remote pool ``device`` is what the pool's machines have, and the baseline for the brief is
            measured here only when this machine has that device.

    Returns:
        The run; its record is also written to ``.workbench/runs/<task>-<n>.json``.

    Raises:
        ValueError: ``attempts`` < 1, a seed list that is too short or holds a public seed, or a bad device.
        WorkbenchError: the task, base or worktree is unusable; AgentError when the backend cannot run
            (the run record then has status ``error``).
    """
    from workbench.agents.baseline import time_baseline
    from workbench.agents.selfcheck import self_check
    from workbench.pipeline import detect_device, draw_runtime_seed, judge_candidate
    from workbench.taskspec import load_task

    if attempts < 1:
        raise ValueError(f"--attempts {attempts}: must be at least 1.")
    root = Path(open_repo(Path(repo_root)).working_dir)
    task = load_task(root, task_id)
    if seeds is not None:
        if len(seeds) < attempts or set(seeds) & set(task.correctness.public_seeds):
            raise ValueError("seeds: need one per attempt, none of them a public seed.")
    dev = detect_device(device) if pool is None else pool.detect_device(device)
    if measure_baseline and pool is not None and dev == "cuda":
        try:
            detect_device("cuda")
        except ValueError:
            logger.info("no CUDA device here: the brief has no baseline timing (the pool judges on cuda)")
            measure_baseline = False
    preflight = getattr(backend, "preflight", None)
    if preflight is not None:  # e.g. the command's program exists: checked before a worktree or branch exists
        preflight()
    awt: AgentWorktree = create_agent_worktree(root, task_id, base)
    sd = state_dir(root)
    logger.info("agent run %s: backend %s, %d attempt(s), worktree %s, base %s", awt.name, backend.label, attempts,
                awt.worktree, awt.base_commit[:12])
    baseline = time_baseline(awt.worktree, task, device=dev) if measure_baseline else None
    brief_text = render_brief(task, repo_root=root, worktree=awt.worktree, base_commit=awt.base_commit, device=dev,
                              baseline_us=baseline, mode=getattr(backend, "brief_mode", "shell"))
    briefs = sd / "briefs"
    briefs.mkdir(parents=True, exist_ok=True)
    brief_path = briefs / f"{awt.name}.md"
    brief_path.write_text(brief_text, encoding="utf-8")
    run = AgentRunResult(task_id, backend.label, awt.branch, awt.worktree, awt.base_commit, brief_path,
                         sd / "runs" / f"{awt.name}.json", [], None, None, TokenUsage())
    _write_record(run, "running")
    feedback_text: str | None = None
    feedback_path: Path | None = None
    try:
        for k in range(1, attempts + 1):
            if k > 1 and not backend.can_revise:
                logger.info("agent run %s: backend %s cannot revise its candidate; stopping after attempt %d",
                            awt.name, backend.name, k - 1)
                break
            prompt_path = briefs / f"{awt.name}-a{k}.prompt.md"
            prompt_path.write_text(brief_text + ("\n\n" + feedback_text if feedback_text else ""), encoding="utf-8")
            transcript = sd / "transcripts" / f"{awt.name}-a{k}.jsonl"
            transcript.parent.mkdir(parents=True, exist_ok=True)
            ctx = AttemptContext(task=task, repo_root=root, worktree=awt.worktree, base_commit=awt.base_commit, attempt=k,
                                 attempts=attempts, brief_file=brief_path, brief_text=brief_text,
                                 feedback_file=feedback_path, feedback_text=feedback_text, prompt_file=prompt_path,
                                 transcript_path=transcript, device=dev,
                                 self_check=lambda: self_check(awt.worktree, task, base=awt.base_commit, device=dev).text())
            logger.info("agent run %s: attempt %d/%d starts (%s)", awt.name, k, attempts,
                        "with feedback" if feedback_text else "from the brief")
            try:
                outcome: AttemptOutcome = backend.attempt(ctx)
            except Exception:
                _write_record(run, "error")
                raise
            run.usage.add(outcome.usage)
            sha, changed = commit_attempt(root, awt, f"{task_id} attempt {k} by {backend.label}")
            logger.info("agent run %s: attempt %d committed %s (%s)", awt.name, k, sha[:10],
                        "changed files" if changed else "no change")
            seed = seeds[k - 1] if seeds is not None else draw_runtime_seed(task)
            cand = Candidate(source=awt.branch, kind="branch", branch=awt.branch, worktree=awt.worktree,
                             base_commit=awt.base_commit, candidate_commit=sha)
            result, path = judge_candidate(
                root, task, cand, device=dev, seed=seed, guards=guards, agent=f"{backend.label} attempt {k}/{attempts}",
                transcript_path=str(transcript), attempt=k, pool=pool,
                command=f"workbench verify {task_id} --branch {sha} --base {awt.base_commit[:12]} --device {dev} --seed {seed}")
            bad = result.first_failure()
            run.attempts.append(AttemptRecord(
                attempt=k, commit=sha, changed=changed, accepted=result.accepted,
                first_failure=f"{bad.guard}: {bad.summary}" if bad else "", result_path=str(path),
                transcript_path=str(transcript), feedback_path=str(feedback_path) if feedback_path else None,
                outcome={"stop_reason": outcome.stop_reason, "submitted": outcome.submitted,
                         "usage": outcome.usage.to_dict(), "note": outcome.note, "duration_s": outcome.duration_s}))
            run.final, run.final_path = result, path
            _write_record(run, "running")
            logger.info("agent run %s: attempt %d %s%s", awt.name, k, "ACCEPTED" if result.accepted else "REJECTED",
                        f" by {bad.guard}" if bad else "")
            if result.accepted:
                break
            if bad is not None and bad.status.value == "ERROR":
                logger.info("agent run %s: a guard broke (ERROR); stopping, the verdict is not a judgement", awt.name)
                break
            # the seed is spent (the next attempt draws a fresh one): the feedback's reproduce command names it
            feedback_text = render_feedback(result, attempt=k, attempts=attempts, task=task)
            feedback_path = briefs / f"{awt.name}-a{k}.feedback.md"
            feedback_path.write_text(feedback_text, encoding="utf-8")
    except KeyboardInterrupt as exc:
        from guards import progress
        from guards.sandbox import kill_all_children

        step = progress.current()
        groups = kill_all_children()
        _write_record(run, "interrupted")
        where = f"{step.guard} ({step.phase})" if step.guard else "the agent's attempt"
        raise Interrupted(f"Interrupted during {where}: stopped {groups} child process group(s); the agent's worktree "
                          f"{awt.worktree} and branch {awt.branch} are kept (attempts so far are committed there; "
                          f"judge one with workbench verify {task_id} --branch {awt.branch}).") from exc
    _write_record(run, "accepted" if run.accepted else "rejected")
    return run
