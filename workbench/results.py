"""The result file: one versioned JSON document per judged candidate, plus its Markdown report.

Source: DESIGN.md "Contracts" (Result file).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from guards.perf_status import PerfStatus
from guards.verdict import Status, Verdict

SCHEMA_VERSION = 2
"""Version 2 added ``seed`` and ``perf_judged``; version 1 files are upgraded when read (:func:`read_result`)."""
READABLE_VERSIONS = (1, SCHEMA_VERSION)

Acceptance = Literal["accepted", "correct_perf_not_judged", "rejected"]
ACCEPTANCE_LABELS: dict[str, str] = {
    "accepted": "ACCEPTED",
    "correct_perf_not_judged": "CORRECT, PERF NOT JUDGED",
    "rejected": "REJECTED",
}
"""What the CLI summary, the Markdown report and the review queue print for each acceptance state."""


def perf_was_judged(verdicts: Sequence[Verdict]) -> bool:
    """Whether the perf guard reached a judgement on the candidate's speed (its verdict is PASS or FAIL).

    SKIP (perf is not judged on this device, no timed workload in the declared scope, or an earlier
    guard stopped the run) and ERROR (the timer broke) are no judgement; neither is a missing perf verdict.
    """
    return any(v.guard == "perf" and v.status in (Status.PASS, Status.FAIL) for v in verdicts)


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CaseResult(_Model):
    """Correctness of one configuration.

    Attributes:
        name: workload name (``random-3`` for run-time draws).
        axes: axis values.
        params: op keyword arguments.
        case: input distribution.
        implementation: what the dispatcher ran for this case (``standard``/``latency_specialized``).
        passed: every call matched the reference.
        mismatches: one line per mismatch (capped).
        calls: calls made (fresh buffers, reused buffers with new data, repeat).
        world_size: TP ranks the case ran on (one process each; 1 for single-process tasks).
        graph_replay: CUDA only: the child's CUDA-graph check of this case (``capture_ms``: warm-up plus
            capture, ``replay_ms``: one replay, milliseconds of host wall clock); ``None`` where no graph
            ran (CPU, a distributed task, the standard path).
    """

    name: str
    axes: dict[str, int]
    params: dict[str, Any]
    case: str
    implementation: str
    passed: bool
    mismatches: tuple[str, ...] = ()
    calls: int = 0
    world_size: int = 1
    graph_replay: dict[str, float | None] | None = None


class PerfResult(_Model):
    """Timing of one configuration: baseline (standard path) vs candidate, interleaved.

    Attributes:
        name: workload name.
        axes: axis values.
        implementation: what the candidate side ran.
        baseline_implementation: what the baseline side ran (``standard``, or ``base kernel`` when a
            kernel for the op is already merged at the base and covers the configuration).
        baseline_us, candidate_us: per-call samples (microseconds).
        baseline_median_us, candidate_median_us: medians (microseconds).
        speedup: median of per-pair ratios baseline / candidate (ratio).
        speedup_ci: bootstrap confidence interval of that median over pairs (ratio, ratio).
        p_slower: one-sided p-value that the candidate is slower (Wilcoxon signed-rank on log ratios).
        verdict: the configuration's :class:`guards.perf_status.PerfStatus` (its value in the file);
            an entry inconsistent with it (e.g. a ``gain`` whose interval reaches 1) is refused.
        timer: ``cpu_thread_time``, ``cpu_wall_clock`` (distributed CPU runs) or ``cuda_event``.
        floor_us: CUDA only; physical floor max(min bytes / measured copy bandwidth, one launch)
            (microseconds); ``below_floor`` when the candidate's median is under 0.9x it.
        tail_excess_us: CUDA only; median candidate tail minus median baseline tail (time from the end
            of the call to a fence after a device-wide sync, microseconds); ``side_stream`` when the
            candidate left work running past its timed window (distributed runs; single-process runs
            synchronize the device inside the judge's window instead).
        candidate_outside_cpu_us: CPU time the candidate's process spent between its calls while this
            workload was timed (microseconds, every thread); ``busy_outside`` when above the bound.
        wait_excess_us: CPU only; median (wall - CPU) of a candidate call minus the baseline's
            (microseconds); ``waits`` when the candidate spends time off-CPU inside its calls.
        event_median_us: CUDA only; median of the candidate's own CUDA-event samples (second opinion).
        mean_ratio, mean_ratio_ci: the candidate's mean wall time per call over the baseline's (ratio) and
            its bootstrap interval; ``mean_regression`` when the interval lies above
            ``1 + guards.perf.MEAN_SLACK x max_regression_pct / 100``.
        load_avg: the machine's highest 1-minute load average while the configuration was timed
            (runnable processes; with ``cpus``, whether the machine was loaded).
        cpus: the machine's logical CPUs.
        pooled_judgings: judgings of the same candidate content whose pairs these statistics pool
            (count; 1: this judging only; ``workbench.retries``).
        extension_rounds: extra rounds of the task's repetitions timed because a claimed gain's interval
            was inconclusive (count; ``guards.perf.PERF_EXTENSION_ROUNDS`` at most).
        late_recheck_gap: untimed calls a side before this configuration's late recheck (count), or ``None``
            when it had none (``guards.perf.PerfGuard._late_rechecks``); the entry's samples are the late
            window's when that window failed on its own.
        outside_cpu_first_window_us: the candidate's CPU time between its calls in the configuration's first
            window (microseconds) when that exceeded the allowance and the configuration was timed once
            more (``guards.perf.busy_outside``), else ``None``; the entry's samples are the second window's
            when it was clean.
        screened: a regression-only configuration cleared on its screening pairs
            (``guards.perf.SCREEN_SHARE`` of the task's repetitions), the rest of its round not timed.

    Raises:
        pydantic.ValidationError: the entry contradicts its verdict (:meth:`PerfStatus.problem`).
    """

    name: str
    axes: dict[str, int]
    implementation: str
    baseline_implementation: str = "standard"
    baseline_us: tuple[float, ...]
    candidate_us: tuple[float, ...]
    baseline_median_us: float
    candidate_median_us: float
    speedup: float
    speedup_ci: tuple[float, float]
    p_slower: float
    verdict: PerfStatus
    timer: str
    floor_us: float | None = None
    tail_excess_us: float | None = None
    candidate_outside_cpu_us: float | None = None
    wait_excess_us: float | None = None
    event_median_us: float | None = None
    mean_ratio: float | None = None
    mean_ratio_ci: tuple[float, float] | None = None
    extension_rounds: int = 0
    screened: bool = False
    late_recheck_gap: int | None = None
    outside_cpu_first_window_us: float | None = None
    pooled_judgings: int = 1
    load_avg: float | None = None
    cpus: int | None = None

    @model_validator(mode="after")
    def _consistent_with_verdict(self) -> PerfResult:
        why = self.verdict.problem(self.model_dump())
        if why is not None:
            raise ValueError(f"perf entry {self.name!r} has verdict {self.verdict.value!r}, but {why}")
        return self


class CandidateInfo(_Model):
    """Where the candidate came from and where it was judged."""

    source: str = Field(description="patch file, overlay folder or branch as given")
    kind: Literal["patch", "folder", "branch"]
    branch: str
    worktree: str
    base_commit: str
    candidate_commit: str
    changed_paths: tuple[str, ...] = ()
    agent: str = "patch"
    transcript_path: str | None = None
    set_aside: str | None = Field(default=None, description="a fixture judged on a fixture base: which merged "
                                  "kernel that base sets aside (such results are never queued for review)")
    target_base: str = Field(default="", description="the base revision the run was asked for (base_commit "
                             "unless a fixture base was made on top of it)")


class RunResult(_Model):
    """Everything about one judged candidate (schema version 2).

    Attributes:
        schema_version: bumped on incompatible changes.
        result_id: file stem, unique per run.
        task_id: the task.
        task_spec_sha256: hash of the task.toml the guards used.
        candidate: provenance.
        environment: versions and device facts (see :func:`workbench.env.collect`).
        device: ``cpu`` or ``cuda``.
        verdicts: in pipeline order.
        accepted: no verdict FAIL or ERROR and the activation guard PASSed (SKIP allowed for guards that
            do not apply). It does not say that a speedup was measured: see ``perf_judged`` and
            :attr:`acceptance`.
        perf_judged: the perf guard judged the candidate's speed on this device (its verdict is PASS or
            FAIL, :func:`perf_was_judged`). An accepted result with ``perf_judged`` false is "correct,
            perf not judged": correctness and activation hold, but no claimed speedup was measured.
        seed: the run-time seed the guards drew their inputs with (``--seed`` reproduces it); ``None``
            only in a schema-1 file whose reproduce command did not name one.
        cases: per-configuration correctness.
        perf: per-configuration timings.
        dispatch_trace: decisions recorded while the candidate ran (op, implementation, reason).
        command: the command that reproduces this result.
        content_key: the candidate's content key (``workbench.retries.content_key``: task, base, device,
            changed files up to comments and docstrings).
        judging: 1-based number of this judging of that content; above 1 the verdict pools the evidence
            of the earlier ones (``pooled_from``).
        pooled_from: result ids of the earlier judgings of the same content.
        started_at: UTC timestamp (ISO 8601).
        duration_s: whole run (seconds).
    """

    schema_version: int = SCHEMA_VERSION
    result_id: str
    task_id: str
    task_spec_sha256: str
    candidate: CandidateInfo
    environment: dict[str, Any]
    device: str
    verdicts: tuple[Verdict, ...]
    accepted: bool
    perf_judged: bool = False
    seed: int | None = None
    cases: tuple[CaseResult, ...] = ()
    perf: tuple[PerfResult, ...] = ()
    dispatch_trace: tuple[dict[str, Any], ...] = ()
    command: str
    content_key: str = ""
    judging: int = 1
    pooled_from: tuple[str, ...] = ()
    started_at: str
    duration_s: float

    @model_validator(mode="after")
    def _perf_judged_needs_a_perf_verdict(self) -> RunResult:
        if self.perf_judged and not any(v.guard == "perf" and v.status is not Status.SKIP for v in self.verdicts):
            raise ValueError("perf_judged is true but the perf guard has no verdict other than SKIP; "
                             "set perf_judged from the verdicts (workbench.results.perf_was_judged).")
        return self

    @property
    def acceptance(self) -> Acceptance:
        """``accepted`` (perf judged too), ``correct_perf_not_judged`` (accepted, no speed measured), ``rejected``."""
        if not self.accepted:
            return "rejected"
        return "accepted" if self.perf_judged else "correct_perf_not_judged"

    @property
    def acceptance_label(self) -> str:
        """``ACCEPTED``, ``CORRECT, PERF NOT JUDGED`` or ``REJECTED`` (:data:`ACCEPTANCE_LABELS`)."""
        return ACCEPTANCE_LABELS[self.acceptance]

    def first_failure(self) -> Verdict | None:
        """The verdict that stopped acceptance (FAIL or ERROR), if any."""
        for v in self.verdicts:
            if v.status in (Status.FAIL, Status.ERROR):
                return v
        return None


def now_utc() -> str:
    """Current UTC time, ISO 8601, seconds precision."""
    return _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()


def write_result(result: RunResult, results_dir: Path) -> Path:
    """Write ``<results_dir>/<result_id>.json`` and its ``.md`` report; return the JSON path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{result.result_id}.json"
    path.write_text(result.model_dump_json(indent=2), encoding="utf-8")
    from workbench.report import render_markdown

    path.with_suffix(".md").write_text(render_markdown(result), encoding="utf-8")
    return path


def read_result(path: Path) -> RunResult:
    """Load a result file; a schema-1 file is upgraded in memory (the file on disk is left as it is).

    Upgrade from 1: ``seed`` is taken from the reproduce command's ``--seed N`` when it names one (else
    ``None``); ``perf_judged`` from the perf verdict (:func:`perf_was_judged`).

    Raises:
        workbench.errors.WorkbenchError: missing file, not JSON, or a schema version this code cannot read.
    """
    from workbench.errors import WorkbenchError

    path = Path(path)
    if not path.is_file():
        raise WorkbenchError(f"Result file {path} does not exist; pass the path printed by `workbench run`.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise WorkbenchError(f"Result file {path}: not JSON ({exc}).") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if not isinstance(data, dict) or not {"schema_version", "task_id", "verdicts"} & set(data):
        raise WorkbenchError(f"Result file {path}: not a workbench result (no schema_version, task_id or verdicts); "
                             "pass a file from .workbench/results/ (the path `workbench run` prints last).")
    if version not in READABLE_VERSIONS:
        raise WorkbenchError(
            f"Result file {path}: schema_version {version!r}; this workbench reads version 1 (upgraded on read) "
            f"and {SCHEMA_VERSION}. Re-run `workbench verify` with a matching workbench."
        )
    try:
        if version == 1:
            data = _upgrade_v1(data)
        return RunResult.model_validate(data)
    except Exception as exc:
        raise WorkbenchError(f"Result file {path}: does not match the schema: {exc}") from None


_SEED_IN_COMMAND = re.compile(r"(?:^|\s)--seed[ =](\d+)(?:\s|$)")


def _upgrade_v1(data: dict[str, Any]) -> dict[str, Any]:
    """A schema-1 document as schema 2: ``seed`` from the command, ``perf_judged`` from the verdicts."""
    out = dict(data, schema_version=SCHEMA_VERSION)
    m = _SEED_IN_COMMAND.search(str(data.get("command", "")))
    out.setdefault("seed", int(m.group(1)) if m else None)
    verdicts = [Verdict.model_validate(v) for v in data.get("verdicts", ())]
    out.setdefault("perf_judged", perf_was_judged(verdicts))
    return out


def file_sha256(path: Path) -> str:
    """SHA-256 hex digest of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
