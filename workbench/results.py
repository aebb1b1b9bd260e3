"""The result file: one versioned JSON document per judged candidate, plus its Markdown report.

Source: DESIGN.md "Contracts" (Result file).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from guards.verdict import Status, Verdict

SCHEMA_VERSION = 1


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
        verdict: ``gain``, ``neutral``, ``regression``, ``no_gain``, ``not_claimed``, ``below_floor``,
            ``side_stream``, ``tampered``
            (timer samples disagree with the wall clock) or ``wrong_output`` (a timed call's outputs
            differ from the reference).
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

    The extra verdicts of the judge's timing (``guards/judge.py``): ``busy_outside``, ``waits`` and
    ``raised`` (a timed call raised or failed a runtime check).
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
    verdict: Literal["gain", "neutral", "regression", "no_gain", "not_claimed", "below_floor", "side_stream",
                     "tampered", "wrong_output", "busy_outside", "waits", "raised"]
    timer: str
    floor_us: float | None = None
    tail_excess_us: float | None = None
    candidate_outside_cpu_us: float | None = None
    wait_excess_us: float | None = None
    event_median_us: float | None = None


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


class RunResult(_Model):
    """Everything about one judged candidate (schema version 1).

    Attributes:
        schema_version: bumped on incompatible changes.
        result_id: file stem, unique per run.
        task_id: the task.
        task_spec_sha256: hash of the task.toml the guards used.
        candidate: provenance.
        environment: versions and device facts (see :func:`workbench.env.collect`).
        device: ``cpu`` or ``cuda``.
        verdicts: in pipeline order.
        accepted: every verdict PASS (SKIP allowed only for guards that do not apply).
        cases: per-configuration correctness.
        perf: per-configuration timings.
        dispatch_trace: decisions recorded while the candidate ran (op, implementation, reason).
        command: the command that reproduces this result.
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
    cases: tuple[CaseResult, ...] = ()
    perf: tuple[PerfResult, ...] = ()
    dispatch_trace: tuple[dict[str, Any], ...] = ()
    command: str
    started_at: str
    duration_s: float

    def first_failure(self) -> Verdict | None:
        """The verdict that stopped acceptance (FAIL or ERROR), if any."""
        for v in self.verdicts:
            if v.status in (Status.FAIL, Status.ERROR):
                return v
        return None


def now_utc() -> str:
    """Current UTC time, ISO 8601, seconds precision."""
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def write_result(result: RunResult, results_dir: Path) -> Path:
    """Write ``<results_dir>/<result_id>.json`` and its ``.md`` report; return the JSON path."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{result.result_id}.json"
    path.write_text(result.model_dump_json(indent=2), encoding="utf-8")
    from workbench.report import render_markdown

    path.with_suffix(".md").write_text(render_markdown(result), encoding="utf-8")
    return path


def read_result(path: Path) -> RunResult:
    """Load a result file.

    Raises:
        workbench.errors.WorkbenchError: missing file, not JSON, or another schema version.
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
    if version != SCHEMA_VERSION:
        raise WorkbenchError(
            f"Result file {path}: schema_version {version!r}; this workbench reads version {SCHEMA_VERSION}."
        )
    try:
        return RunResult.model_validate(data)
    except Exception as exc:
        raise WorkbenchError(f"Result file {path}: does not match the schema: {exc}") from None


def file_sha256(path: Path) -> str:
    """SHA-256 hex digest of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
