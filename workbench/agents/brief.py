"""The brief an agent works from, and the feedback it gets after a rejected attempt.

The brief is rendered from the task spec: target and contract (axes, tensors with shapes and dtypes,
scope), allowed paths, the fixed workloads and tolerances, the baseline's numbers, how to self-check,
and the rules (``AGENTS.md``). It is written under ``.workbench/briefs/`` (git-ignored), never into
the worktree's tracked files. Neither text ever carries a run-time seed: the brief is rendered before
any seed is drawn, feedback is built from verdicts and cases only (never the result's ``command``),
and :func:`redact` removes a seed should one ever appear in evidence.

Source: issue 4 ("Brief", "Attempts"); DESIGN.md "Trust model".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

from workbench.results import RunResult
from workbench.taskspec import TaskSpec

MAX_FEEDBACK_CASES = 6
"""Failing configurations quoted in feedback (count)."""
MAX_EVIDENCE = 10
"""Evidence items of the deciding verdict quoted in feedback (count)."""


def _tensor_lines(kind: str, tensors) -> list[str]:
    out = []
    for name, t in tensors.items():
        poison = f"; poisoned with {t.poison} before each call" if t.poison is not None else ""
        out.append(f"- `{name}` ({kind}): shape ({', '.join(t.shape)}) {t.dtype}: {t.description.strip()}{poison}")
    return out


def render_brief(task: TaskSpec, *, repo_root: Path, worktree: Path, base_commit: str, device: str,
                 baseline_us: Mapping[str, float] | None, mode: Literal["tools", "shell"]) -> str:
    """The brief's Markdown text.

    Args:
        task: the task spec.
        repo_root: the workbench's checkout (``AGENTS.md`` is read there).
        worktree: the agent's worktree (its path is shown to shell agents; the op's README is read there).
        base_commit: SHA candidates are judged against.
        device: ``cpu`` or ``cuda`` (where the guards will run).
        baseline_us: perf workload -> standard-path median (microseconds), or ``None``/empty when unknown.
        mode: ``tools`` for the API backend (list_files/read_file/write_file/run_check/submit),
            ``shell`` for a CLI agent working in the worktree.

    Returns:
        Markdown text.
    """
    s = task.scope
    mod, fn = task.target.split(":")
    std_file = mod.replace(".", "/") + ".py"
    lines = [
        f"# Task `{task.task_id}`: a latency-specialized `{task.op}` kernel for K3",
        "",
        task.description.strip(),
        "",
        "## Target and contract",
        f"- Implement the op `{task.op}` with the signature and semantics of `{task.target}` "
        f"(standard path and argument checks in `{std_file}`; read it first).",
        "- The kernel package defines `SCOPE = OpScope(...)` (from `k3_model.dispatch`) and the entry point; "
        "the dispatcher runs it only inside `SCOPE` and records every decision.",
        f"- Task scope: devices {list(s.devices)}, phases {list(s.phases)}, TP sizes {list(s.tp_sizes)}, "
        f"dtypes {list(s.dtypes)} (of input `{s.dtype_input}`), batch axis `{s.batch_axis}` in "
        f"[{s.batch_min}, {s.batch_max}]. The guards run on **{device}**.",
        "- Axes: " + "; ".join(f"`{k}` = {v.description}" for k, v in task.axes.items()) + ".",
    ]
    if task.axis_params:
        lines.append("- Keyword arguments taken from axes: "
                     + ", ".join(f"`{k}` = {v}" for k, v in task.axis_params.items()) + ".")
    lines += ["", "Tensors (outputs are preallocated by the caller and poisoned; write every element):"]
    lines += _tensor_lines("input", task.inputs) + _tensor_lines("output", task.outputs)
    lines += ["", "Tolerances:"]
    for name, tol in task.correctness.tolerance.items():
        how = "exact" if tol.exact else f"rtol {tol.rtol:g}, atol {tol.atol:g}"
        lines.append(f"- `{name}`: {how} (source: {tol.source})")
    lines += ["", "## Allowed paths",
              "You may create or change only: " + ", ".join(f"`{p}`" for p in task.allowed_paths) + ".",
              "Always forbidden: " + ", ".join(f"`{p}`" for p in task.all_forbidden) + "; no symlinks leaving "
              "the allowed paths, no binary files.", ""]
    readme = Path(worktree) / "k3_model" / "kernels" / task.op / "README.md"
    if readme.is_file():
        lines += [f"## `{readme.relative_to(worktree)}`", "", readme.read_text(encoding="utf-8").strip(), ""]
    lines += ["## Workloads",
              "Correctness runs every fixed workload below (three calls each: fresh buffers, the same buffers "
              "refilled with new data, fresh again) plus "
              f"{task.correctness.random_draws} configurations drawn at judging time inside the scope, from a "
              "seed you never see. Inputs are redrawn on every run.", ""]
    for w in task.correctness.workloads:
        axes = ", ".join(f"{k}={v}" for k, v in w.axes.items())
        params = ", ".join(f"{k}={v}" for k, v in w.params.items())
        note = f" ({w.note})" if w.note else ""
        lines.append(f"- `{w.name}`: {axes}; {params}; case `{w.case}`{note}")
    lines += ["", "## Performance",
              f"Timed workloads: {', '.join(task.perf.workloads)}. Baseline = the standard path, interleaved "
              f"with your kernel in one process. Required: no configuration slower by more than "
              f"{task.perf.max_regression_pct:g} %, and at least {task.perf.min_speedup:g}x (confidence interval "
              "above 1) wherever `SCOPE` claims your path runs.", ""]
    if baseline_us:
        lines.append(f"Baseline medians on this machine ({device}, measured before you started):")
        for name in task.perf.workloads:
            if name in baseline_us:
                lines.append(f"- `{name}`: {baseline_us[name]:.1f} us per call")
    else:
        lines.append("Baseline medians: not measured for this run.")
    lines += ["", "## How to self-check"]
    if mode == "tools":
        lines += ["Call the `run_check` tool: paths, correctness on the public seeds "
                  f"{list(task.correctness.public_seeds)} (fixed workloads only), activation, and a quick perf "
                  "estimate. It takes seconds to a minute. Then call `submit`."]
    else:
        lines += [f"Your working directory is the worktree `{worktree}` (a git checkout of base "
                  f"`{base_commit[:12]}`). Run:", "",
                  "```bash", f"workbench check {task.task_id} --base {base_commit}", "```", "",
                  "(or `python -m workbench check ...`): paths, correctness on the public seeds "
                  f"{list(task.correctness.public_seeds)} (fixed workloads only), activation, and a quick perf "
                  "estimate. Leave your files in the worktree when you finish; the workbench commits them."]
    lines += ["A self-check PASS is a hint, not the verdict: the guards judge again with fresh inputs, random "
              "batch sizes and more timing repetitions.", "", "## Rules", ""]
    agents_md = Path(repo_root) / "AGENTS.md"
    if agents_md.is_file():
        lines.append(agents_md.read_text(encoding="utf-8").strip())
    lines.append("")
    return "\n".join(lines)


def redact(text: str, secrets: Iterable[int | str]) -> str:
    """Replace each secret (a seed) where it stands as a whole token with ``<redacted>``."""
    for s in secrets:
        s = str(s)
        if s:
            text = re.sub(rf"(?<![0-9A-Za-z]){re.escape(s)}(?![0-9A-Za-z])", "<redacted>", text)
    return text


def render_feedback(result: RunResult, *, attempt: int, attempts: int, hidden: Iterable[int | str] = ()) -> str:
    """Feedback for the next attempt: every verdict, the deciding one's evidence, the failing cases.

    Args:
        result: the rejected attempt's result.
        attempt: that attempt's number (1-based).
        attempts: attempts allowed in the run.
        hidden: values never to show (the run-time seed); redacted if they appear.

    Returns:
        Markdown text; it never includes the result's reproduce command (which names the seed).
    """
    lines = [f"# Feedback on attempt {attempt} of {attempts}: "
             f"{'ACCEPTED' if result.accepted else 'REJECTED'}", "",
             f"Judged commit `{result.candidate.candidate_commit[:12]}` (changed: "
             f"{', '.join(result.candidate.changed_paths) or 'nothing'}).", "", "## Verdicts"]
    for v in result.verdicts:
        lines.append(f"- {v.guard}: {v.status.value}: {v.summary}")
    bad = result.first_failure()
    if bad is not None:
        lines += ["", f"## Evidence from {bad.guard}"]
        for e in bad.evidence[:MAX_EVIDENCE]:
            where = f" [{e.path}]" if e.path else ""
            lines.append(f"- {e.name}{where}: {str(e.value)[:600]}{(' ' + e.unit) if e.unit else ''}")
    failing = [c for c in result.cases if not c.passed]
    if failing:
        lines += ["", f"## Failing configurations ({len(failing)} of {len(result.cases)})"]
        for c in failing[:MAX_FEEDBACK_CASES]:
            axes = ", ".join(f"{k}={v}" for k, v in c.axes.items())
            lines.append(f"- `{c.name}` ({axes}; case {c.case}; ran {c.implementation}):")
            lines += [f"  - {m[:300]}" for m in c.mismatches[:3]]
    bad_perf = [p for p in result.perf if p.verdict in ("regression", "no_gain")]
    if bad_perf:
        lines += ["", "## Timing"]
        for p in result.perf:
            lines.append(f"- `{p.name}`: {p.speedup:.3f}x (baseline {p.baseline_median_us:.1f} us, yours "
                         f"{p.candidate_median_us:.1f} us, CI [{p.speedup_ci[0]:.3f}, {p.speedup_ci[1]:.3f}]): {p.verdict}")
    lines += ["", "Your files from the last attempt are still in the worktree. Reproduce the failure with the "
              "self-check where you can, fix the cause (never special-case shapes or seeds), and submit again."]
    return redact("\n".join(lines), hidden)
