"""The brief an agent works from, and the feedback it gets after a rejected attempt.

The brief is rendered from the task spec: target and contract (axes, tensors with shapes and dtypes,
scope and the scope rule), allowed paths, the fixed workloads and tolerances, how the judge times and
what fails there, the baseline's medians with their spread and method, the agent's ``WORKBENCH_*``
variables and command placeholders (shell agents) or tools, how to self-check, and the rules
(``AGENTS.md``); what does not apply to the task, device or backend is left out. It is written under
``.workbench/briefs/`` (git-ignored), never into the worktree's tracked files, and is rendered before
any seed is drawn.

Feedback states, for each failing check, the guard, the cause (candidate or environment), the
configurations, what was expected and seen, and the command that reproduces it with the judging's
seed: that seed is spent (each judging draws a fresh one), so showing it helps no later attempt.
:func:`redact` removes any value a caller says must stay hidden.

Source: issue 4 ("Brief", "Attempts"); issue 20 items 4-5; DESIGN.md "Trust model".
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Literal

from guards.verdict import Status, Verdict
from workbench.agents.baseline import BaselineTimings
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


def workload_line(w) -> str:
    """One workload as a brief line: name, axes, params, case, note; a part that is empty is left out."""
    parts = [", ".join(f"{k}={v}" for k, v in w.axes.items()), ", ".join(f"{k}={v}" for k, v in w.params.items()),
             f"case `{w.case}`" if w.case else ""]
    note = f" ({w.note})" if w.note else ""
    return f"- `{w.name}`: " + "; ".join(p for p in parts if p) + note


def _bullets(markdown: str) -> list[str]:
    """``markdown`` split into blocks: each top-level ``- `` bullet with its continuation lines, or a line."""
    blocks: list[str] = []
    for line in markdown.strip().splitlines():
        if blocks and line.startswith((" ", "\t")) and blocks[-1].startswith("- "):
            blocks[-1] += "\n" + line
        else:
            blocks.append(line)
    return blocks


DISTRIBUTED_RULE_PREFIX = "- Distributed tasks"
"""An ``AGENTS.md`` bullet starting so applies to distributed tasks only; other tasks' briefs leave it out."""


def rules_text(agents_md: str, *, distributed: bool) -> str:
    """``AGENTS.md`` as the brief quotes it: without the distributed-task bullet for a single-process task."""
    keep = [b for b in _bullets(agents_md) if distributed or not b.startswith(DISTRIBUTED_RULE_PREFIX)]
    return "\n".join(keep)


def _query(s) -> str:
    """The requests and query-length part of a scope line."""
    qa = s.query_axis
    q = "1" if qa is None else (f"1 + `{qa[0]}`" if qa[1] else f"`{qa[0]}`")
    if qa is None:
        return f"requests `{s.requests_axis}` in [{s.requests_min}, {s.requests_max}], query length 1 (decode steps)"
    steps = "decode steps at query length 1, verification steps above" if "decode" in s.phases else "verification steps"
    if s.rows_axis is not None:
        return (f"token rows `{s.rows_axis}` of requests in [{s.requests_min}, {s.requests_max}] at query length {q} in "
                f"[{s.query_len_min}, {s.query_len_max}] (requests = ceil(`{s.rows_axis}` / query length); {steps}; a "
                "`SCOPE` may also bound the rows it runs with `rows_max`)")
    return (f"requests `{s.requests_axis}` in [{s.requests_min}, {s.requests_max}], query length {q} in "
            f"[{s.query_len_min}, {s.query_len_max}] ({steps})")


def _scope_lines(task: TaskSpec, device: str) -> list[str]:
    s = task.scope
    tp = f", TP sizes {list(s.tp_sizes)}" if task.distributed is not None else ""
    lines = [f"- Task scope: devices {list(s.devices)}, phases {list(s.phases)}{tp}, dtypes {list(s.dtypes)} (of input "
             f"`{s.dtype_input}`), {_query(s)}. "
             f"The guards run on **{device}**."]
    claim = [f"devices: only `{device}` (the device this run judges)", f"phases within {list(s.phases)}",
             f"dtypes within {list(s.dtypes)}", f"requests_min/requests_max within [{s.requests_min}, {s.requests_max}]",
             f"query_len_min/query_len_max within [{s.query_len_min}, {s.query_len_max}]"]
    if task.distributed is not None:
        per_rank = "one GPU per rank" if device == "cuda" else "one process per rank"
        claim.append(f"TP sizes within {list(s.tp_sizes)} and only the world sizes this run judges ({per_rank})")
    else:
        claim.append("TP size 1 only (a single-process task)")
    lines.append("- Scope rule: `SCOPE` must claim exactly what is judged: " + "; ".join(claim) + ". The activation "
                 "guard rejects a `SCOPE` that claims a "
                 + ("device, request count, query length, dtype, phase or world size" if task.distributed is not None
                    else "device, request count, query length, dtype or phase")
                 + " that is not judged in this run, and fails any judged configuration inside `SCOPE` that did "
                 "not run your kernel (or one outside it that did).")
    return lines


def _environment_lines(mode: str) -> list[str]:
    from workbench.agents.command_backend import PLACEHOLDER_MEANINGS
    from workbench.envs import AGENT_VARIABLES

    if mode == "tools":
        return ["## Your tools",
                "You work through the tools `list_files`, `read_file`, `write_file` (refused outside the allowed "
                "paths), `run_check` (the self-check below) and `submit` (you are done); no shell, no environment "
                "variables.", ""]
    lines = ["## Your environment",
             "The workbench sets these variables for your command (exact names; nothing else of its environment "
             "reaches you but `PATH`, `LANG`, `LC_ALL`, `TERM`, `TZ`, a private `HOME` and what the person running "
             "it passed with `--agent-env`):"]
    lines += [f"- `{name}`: {meaning}" for name, meaning in AGENT_VARIABLES.items()]
    lines += ["", "The command line that started you (`--agent-cmd`) may use these placeholders:"]
    lines += [f"- `{{{name}}}`: {meaning}" for name, meaning in PLACEHOLDER_MEANINGS.items()]
    return lines + [""]


def _timing_lines(task: TaskSpec, device: str) -> list[str]:
    """How the perf guard times on ``device`` and what fails there (only that device's method)."""
    from guards import perf as P

    pf = task.perf
    max_reg, alpha = pf.regression_test(device)
    lines = ["## Performance"]
    if device not in pf.devices:
        why = f" ({pf.devices_reason})" if pf.devices_reason else ""
        return lines + [f"Performance is not judged on {device} for this task (it is on {', '.join(pf.devices)}){why}. "
                        "A result here is \"correct, perf not judged\"; it never counts as a speedup.", ""]
    s = task.scope
    drawn = "" if task.distributed is not None else (
        f", plus {P.PERF_RANDOM_DRAWS} values of `{s.batch_axis}` drawn at judging time in the scope's range"
        + (f" and {P.PERF_DOMAIN_DRAWS} configurations drawn over the task's whole domain (every "
                            f"axis and param; regimes {', '.join(P.timed_regimes(task))})" if task.domain else "")
        + " (timed where `SCOPE` claims them; judged for regressions only)")
    lines += [f"Timed workloads: {', '.join(f'`{n}`' for n in pf.workloads)}{drawn}. Required: no configuration "
              f"slower than the baseline by more than {max_reg:g} % (one-sided test at alpha {alpha:g}), and at "
              f"least {pf.min_speedup:g}x (median of paired ratios, its {pf.confidence:.0%} bootstrap interval "
              "above 1) wherever `SCOPE` claims your path runs.", "",
              "How the judge times (docs/trust-model.md):",
              "- The judge (the workbench's process) owns the clocks and the inputs: for each call it draws fresh "
              "inputs, writes them into shared memory, poisons your outputs, says go and reads the outputs at done. "
              f"Baseline and your kernel get the same inputs per call, interleaved A B / B A; {pf.warmup} warm-up "
              f"and {pf.repetitions} timed calls per side and workload.",
              "- **Every** call's outputs are checked, warm-up included: a wrong output while timed fails the run."]
    if task.distributed is not None:
        lines.append("- World sizes above 1 are timed inside the rank processes (wall clock on CPU, CUDA events on "
                     "GPUs, cross-checked against the wall clock); every rank must finish its work inside the call.")
    if device == "cpu":
        lines += ["- The clock is the **CPU time of your child process**, all its threads together (no credit for "
                  "parallelism), read by the judge; your own timers are never read.",
                  f"- CPU time spent *between* calls fails the run (background or deferred work; allowance "
                  f"{P.OUTSIDE_CPU_ABS_US:g} us + {P.OUTSIDE_CPU_REL:.0%} of the in-call CPU time per workload).",
                  "- Waiting off-CPU inside a call (sleeping, blocking) fails the run: the judge's wall clock minus "
                  f"the CPU time may exceed the baseline's by at most max({P.WAIT_ABS_US:g} us, {P.WAIT_REL:.0%} of "
                  "the baseline median) per call."]
    else:
        lines += ["- The clock is the **judge's wall clock** per call; your process synchronizes the whole device "
                  "before done, so work on any stream counts.",
                  "- CUDA events are a second opinion: an event longer than the judge's window (timer tampering) or "
                  "a median below the physical floor (bytes / copy bandwidth, one launch) fails the run."]
    lines += [f"- A claimed gain whose median reaches {pf.min_speedup:g}x but whose interval still reaches 1 "
              f"(inconclusive, e.g. a loaded machine) gets up to {P.PERF_EXTENSION_ROUNDS} extension rounds of "
              f"{pf.repetitions} more calls per side on fresh inputs, every output checked, before the verdict.", ""]
    return lines


def _baseline_lines(task: TaskSpec, device: str,
                    baseline: Mapping[str, float] | BaselineTimings | None) -> list[str]:
    if device not in task.perf.devices:
        return []
    measured = baseline.workloads if isinstance(baseline, BaselineTimings) else (baseline or {})
    if not measured:
        return ["Baseline medians: not measured for this run.", ""]
    if isinstance(baseline, BaselineTimings):
        lines = [f"Baseline (standard path) on this machine ({device}), measured once before you started: median "
                 f"and 10th-90th percentile range of {baseline.repetitions} timed calls on each of two standard-path "
                 f"sides after {baseline.warmup} warm-up calls, inputs from public seed {baseline.seed}, timer: "
                 f"{baseline.timer}:"]
        for name in task.perf.workloads:
            t = baseline.workloads.get(name)
            if t is not None:
                lines.append(f"- `{name}`: {t.median_us:.1f} us per call (range {t.p10_us:.1f}-{t.p90_us:.1f} us, "
                             f"{t.spread_pct:.0f} % of the median; {t.samples} samples)")
    else:
        lines = [f"Baseline (standard path) medians on this machine ({device}), measured once before you started "
                 "(spread not measured):"]
        lines += [f"- `{name}`: {measured[name]:.1f} us per call" for name in task.perf.workloads if name in measured]
    lines += ["These are rough: a short run with the child's own timer. The judge times the baseline again, "
              "interleaved with your kernel and with its own clock, at judging time; on a loaded machine its "
              "numbers can differ by tens of percent. Only the paired ratio decides.", ""]
    return lines


def render_brief(task: TaskSpec, *, repo_root: Path, worktree: Path, base_commit: str, device: str,
                 baseline_us: Mapping[str, float] | BaselineTimings | None, mode: Literal["tools", "shell"]) -> str:
    """The brief's Markdown text: only what applies to this task, device and backend.

    Args:
        task: the task spec.
        repo_root: the workbench's checkout (``AGENTS.md`` is read there).
        worktree: the agent's worktree (its path is shown to shell agents; the op's README is read there).
        base_commit: SHA candidates are judged against.
        device: ``cpu`` or ``cuda`` (where the guards will run).
        baseline_us: the quick baseline (:func:`workbench.agents.baseline.time_baseline`: medians with their
            spread), or perf workload -> standard-path median (microseconds), or ``None``/empty when unknown.
        mode: ``tools`` for the API backend (list_files/read_file/write_file/run_check/submit),
            ``shell`` for a CLI agent working in the worktree (its variables and placeholders are listed).

    Returns:
        Markdown text. A single-process task's brief carries no distributed-task rule and no TP sizes; a
        device where the task does not judge perf gets no timing method and no baseline.
    """
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
        *_scope_lines(task, device),
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
              "seed you never see before the verdict. Inputs are redrawn on every run.", ""]
    lines += [workload_line(w) for w in task.correctness.workloads]
    lines += [""]
    lines += _timing_lines(task, device)
    lines += _baseline_lines(task, device, baseline_us)
    lines += _environment_lines(mode)
    lines += ["## How to self-check"]
    if mode == "tools":
        lines += ["Call the `run_check` tool: the judge's own guards on your files as they are (isolation, "
                  f"audit, correctness on public seed {list(task.correctness.public_seeds[:1])} with the fixed "
                  "workloads, activation, and a short perf estimate). It takes seconds to a minute. Then call "
                  "`submit`."]
    else:
        lines += [f"Your working directory is the worktree `{worktree}` (a git checkout of base "
                  f"`{base_commit[:12]}`). Run:", "",
                  "```bash", f"workbench check {task.task_id} --base {base_commit}", "```", "",
                  "(or `python -m workbench check ...`): the judge's own guards on your files as they are, "
                  "committed or not (isolation, audit, correctness on public seed "
                  f"{list(task.correctness.public_seeds[:1])} with the fixed workloads, activation, and a short "
                  "perf estimate; about 15-60 s). `--full` adds the public seeds "
                  f"{list(task.correctness.public_seeds)}, the largest workloads and the model eval (minutes). "
                  "Leave your files in the worktree when you finish; the workbench commits them."]
    lines += ["A self-check PASS is a hint, not the verdict: the guards judge again with fresh inputs, random "
              "batch sizes and more timing repetitions. After a rejection the feedback names each failing check, "
              "its configuration, what was expected and seen, whether the cause is your code or the environment, "
              "and the command (with that judging's seed) that reproduces it. Resubmitting the same content "
              "(comments, whitespace and docstrings aside) does not buy a new chance: its judgings are pooled, "
              "a bug found once stays found and the perf statistics use the pairs of every judging.",
              "", "## Rules", ""]
    agents_md = Path(repo_root) / "AGENTS.md"
    if agents_md.is_file():
        lines.append(rules_text(agents_md.read_text(encoding="utf-8"), distributed=task.distributed is not None))
    lines.append("")
    return "\n".join(lines)


def redact(text: str, secrets: Iterable[int | str]) -> str:
    """Replace each secret (a seed) where it stands as a whole token with ``<redacted>``."""
    for s in secrets:
        s = str(s)
        if s:
            text = re.sub(rf"(?<![0-9A-Za-z]){re.escape(s)}(?![0-9A-Za-z])", "<redacted>", text)
    return text


Cause = Literal["candidate", "environment"]

_LOAD_EVIDENCE = re.compile(r"(^|_)(machine_)?load(_|$)")
_LOAD_WORDS = ("machine load", "loaded machine", "machine was loaded", "contention")
_ENV_CHILD_PROBLEMS = ("exceeded its", "never started", "response unreadable", "response is not a dict")


def failure_cause(verdict: Verdict) -> tuple[Cause, str]:
    """Whether a FAIL or ERROR verdict points at the candidate or at the environment, and why.

    Environment: the guard broke (ERROR: an infrastructure error, not a judgement); a machine-load
    signal in the evidence (an evidence item named ``load``/``machine_load``/``..._load_...``) or in the
    summary; a child that ran past its wall-clock limit, never started or answered unreadably.
    Everything else a guard FAILs on (a wrong output, a regression, a forbidden path, a scope claim, a
    crash of your code) is the candidate's.

    Returns:
        ``(cause, one sentence saying why)``.
    """
    if verdict.status is Status.ERROR:
        return "environment", ("the guard itself broke (an infrastructure error); this is no judgement of your code: "
                               "re-run the reproduce command, and report it if it persists")
    load = [e for e in verdict.evidence if _LOAD_EVIDENCE.search(e.name)]
    if load or any(w in verdict.summary.lower() for w in _LOAD_WORDS):
        what = f" ({load[0].name} = {load[0].value}{(' ' + load[0].unit) if load[0].unit else ''})" if load else ""
        return "environment", f"the machine was loaded while this was measured{what}; the same code may pass on a quiet one"
    for e in verdict.evidence:
        if e.name.endswith("child_problem") and any(m in str(e.value) for m in _ENV_CHILD_PROBLEMS):
            if "exceeded its" in str(e.value):
                return "environment", (f"{e.value}: a child timeout, which a loaded machine can cause; if your code "
                                       "can loop or wait that long, it is yours")
            return "environment", f"{e.value}: the judge could not run or read the child"
    return "candidate", {
        "correctness": "your kernel's outputs differ from the reference (or your code did not complete)",
        "perf": "your kernel's timing or its outputs while timed broke a rule of the perf guard",
        "activation": "your kernel's declared scope or dispatch does not match what ran",
        "isolation": "your change touches what a candidate may not",
        "audit": "your source uses a construct the static audit refuses",
        "model_eval": "the model decodes differently with your kernel",
    }.get(verdict.guard, f"the {verdict.guard} guard rejected your change")


def reproduce_command(result: RunResult) -> str:
    """The command that judges the same commit with the same seed, so every check sees the same inputs.

    The result's own reproduce command when it names the result's seed (it repeats any
    ``WORKBENCH_MODEL_EVAL_*`` setting in effect), else a ``workbench verify`` line built from the result.
    """
    if result.seed is None or re.search(rf"--seed[ =]{result.seed}(\s|$)", result.command):
        return result.command  # a schema-1 result without a seed: its own command is all there is
    return (f"workbench verify {result.task_id} --branch {result.candidate.candidate_commit} "
            f"--base {result.candidate.base_commit[:12]} --device {result.device} --seed {result.seed}")


_EXPECTED = {
    "isolation": "changes only under the allowed paths, no symlink leaving them, no binary or oversized file",
    "audit": "source free of the constructs the static audit refuses (see each finding)",
    "activation": "a plain-data `SCOPE` within what this run judges, your changed code imported, your kernel run "
                  "exactly inside `SCOPE` and the standard path outside it",
    "model_eval": "the model's greedy tokens unchanged and its log-probabilities within the drift bound",
}


def _case_line(c) -> str:
    axes = ", ".join(f"{k}={v}" for k, v in c.axes.items())
    ranks = f"; {c.world_size} ranks" if c.world_size > 1 else ""
    return f"`{c.name}` ({axes}; case {c.case}; ran {c.implementation}{ranks})"


def _expected_correctness(task: TaskSpec | None) -> str:
    tol = ""
    if task is not None:
        tol = " (" + "; ".join(f"`{n}` {'exact' if t.exact else f'rtol {t.rtol:g}, atol {t.atol:g}'}"
                               for n, t in task.correctness.tolerance.items()) + ")"
    return f"every output of every call (fresh, reused and repeated buffers) within tolerance of the reference{tol}"


def _expected_perf(task: TaskSpec | None, device: str) -> str:
    if task is None:
        return ("no configuration slower than the baseline beyond the task's bound, the claimed gain with its "
                "interval above 1, every timed call's outputs right, no work between or waiting inside calls")
    max_reg, _ = task.perf.regression_test(device)
    return (f"no configuration more than {max_reg:g} % slower than the baseline; at least {task.perf.min_speedup:g}x "
            f"with the {task.perf.confidence:.0%} interval above 1 where `SCOPE` claims your path; every timed call's "
            "outputs right; no CPU work between calls, no off-CPU waits inside them")


def _perf_seen(p) -> str:
    extra = []
    if p.extension_rounds:
        extra.append(f"{p.extension_rounds} extension round(s)")
    if p.wait_excess_us is not None and p.verdict == "waits":
        extra.append(f"{p.wait_excess_us:.0f} us more off-CPU per call than the baseline")
    if p.candidate_outside_cpu_us is not None and p.verdict == "busy_outside":
        extra.append(f"{p.candidate_outside_cpu_us:.0f} us CPU between calls")
    more = f"; {'; '.join(extra)}" if extra else ""
    return (f"`{p.name}` ({', '.join(f'{k}={v}' for k, v in p.axes.items())}; ran {p.implementation}): {p.verdict}, "
            f"{p.speedup:.3f}x, CI [{p.speedup_ci[0]:.3f}, {p.speedup_ci[1]:.3f}], baseline {p.baseline_median_us:.1f} "
            f"us, yours {p.candidate_median_us:.1f} us ({p.timer}){more}")


def _evidence_line(e) -> str:
    where = f" [{e.path}]" if e.path else ""
    return f"{e.name}{where}: {str(e.value)[:600]}{(' ' + e.unit) if e.unit else ''}"


def _evidence_configs(result: RunResult, verdict: Verdict) -> list[str]:
    """The configurations a verdict's evidence points at (its paths), with their axes where a judged case has
    that name (the activation guard's paths read ``<workload> batch=<n>``)."""
    cases = {c.name: c for c in result.cases}
    out: list[str] = []
    for path in dict.fromkeys(e.path for e in verdict.evidence if e.path):
        c = cases.get(path.split(" ", 1)[0])
        line = _case_line(c) if c is not None else f"`{path}`"
        if line not in out:
            out.append(line)
    return out[:MAX_FEEDBACK_CASES]


_BAD_PERF = ("regression", "no_gain", "below_floor", "side_stream", "tampered", "wrong_output", "busy_outside", "waits",
             "raised", "compiled_timed", "mean_regression")


def failure_block(result: RunResult, verdict: Verdict, task: TaskSpec | None = None) -> list[str]:
    """One failing verdict as the feedback states it: guard, cause, configurations, expected, seen, reproduce.

    Args:
        result: the judged attempt.
        verdict: one of its FAIL or ERROR verdicts.
        task: the task spec (for tolerances and thresholds; without it the expectations are stated generally).

    Returns:
        Markdown lines.
    """
    cause, why = failure_cause(verdict)
    lines = [f"### {verdict.guard}: {verdict.status.value}", f"- Guard: `{verdict.guard}`: {verdict.summary}",
             f"- Cause: **{cause}**: {why}."]
    configs: list[str] = []
    seen: list[str] = []
    label = "Configurations"
    if verdict.guard == "correctness":
        failing = [c for c in result.cases if not c.passed]
        expected = _expected_correctness(task)
        for c in failing[:MAX_FEEDBACK_CASES]:
            configs.append(_case_line(c))
            seen += [f"`{c.name}`: {m[:300]}" for m in c.mismatches[:3]] or [f"`{c.name}`: wrong (no detail kept)"]
        if len(failing) > MAX_FEEDBACK_CASES:
            configs.append(f"... and {len(failing) - MAX_FEEDBACK_CASES} more (`workbench report RESULT` lists all)")
        label = f"Configurations ({len(failing)} of {len(result.cases)} judged fail)" if failing else label
    elif verdict.guard == "perf":
        expected = _expected_perf(task, result.device)
        bad = [p for p in result.perf if p.verdict in _BAD_PERF]
        configs = [f"`{p.name}` ({', '.join(f'{k}={v}' for k, v in p.axes.items())})" for p in bad[:MAX_FEEDBACK_CASES]]
        seen = [_perf_seen(p) for p in bad[:MAX_FEEDBACK_CASES]]
    else:
        expected = _EXPECTED.get(verdict.guard, f"a PASS of the {verdict.guard} guard")
        if verdict.guard == "model_eval":
            ev = {e.name: e.value for e in verdict.evidence}
            if {"batch", "context_tokens", "generated_tokens"} <= set(ev):
                configs = [f"K3-mini decode: batch {ev['batch']} sequences, a {ev['context_tokens']}-token context, "
                           f"{ev['generated_tokens']} generated tokens per sequence"]
    if not seen:
        seen = [_evidence_line(e) for e in verdict.evidence[:MAX_EVIDENCE]] or [verdict.summary]
    if not configs:
        configs = _evidence_configs(result, verdict) or ["not one configuration: the check covers the whole candidate"]
    if len(configs) == 1:
        lines.append(f"- {label.removesuffix('s') if label == 'Configurations' else label}: {configs[0]}")
    else:
        lines.append(f"- {label}:")
        lines += [f"  - {c}" for c in configs]
    lines.append(f"- Expected: {expected}.")
    lines.append("- Seen:" + (f" {seen[0]}" if len(seen) == 1 else ""))
    if len(seen) > 1:
        lines += [f"  - {x}" for x in seen]
    same = f"same seed {result.seed}" if result.seed is not None else "the recorded seed"
    lines += [f"- Reproduce exactly this check (same commit, {same}, same inputs; it stops at this guard again):",
              "", "  ```bash", f"  {reproduce_command(result)}", "  ```",
              f"  then `workbench report` on the result file it prints. The public-seed self-check "
              f"(`workbench check {result.task_id} --base {result.candidate.base_commit[:12]}`) runs the fixed "
              "workloads only and may not reach a configuration drawn at judging time."]
    return lines


def render_feedback(result: RunResult, *, attempt: int, attempts: int, hidden: Iterable[int | str] = (),
                    task: TaskSpec | None = None) -> str:
    """Feedback for the next attempt: every verdict, and for each FAIL or ERROR what an agent can act on.

    For each failing verdict (:func:`failure_block`): the guard, whether the cause is the candidate or
    the environment (:func:`failure_cause`), the configurations (workload names and axes), what was
    expected and what was seen, and the command that reproduces exactly that check with the judging's
    seed. That seed is shown: it is spent (every judging draws a fresh one, so knowing it helps no later
    attempt), and without it a configuration drawn at judging time cannot be reproduced.

    Args:
        result: the rejected attempt's result.
        attempt: that attempt's number (1-based).
        attempts: attempts allowed in the run.
        hidden: values never to show, redacted wherever they appear (e.g. a seed that will judge again).
        task: the task spec, for tolerances and thresholds in "expected" (optional).

    Returns:
        Markdown text.
    """
    lines = [f"# Feedback on attempt {attempt} of {attempts}: "
             f"{'ACCEPTED' if result.accepted else 'REJECTED'}", "",
             f"Judged commit `{result.candidate.candidate_commit[:12]}` on {result.device}"
             + (f" with seed {result.seed}" if result.seed is not None else "")
             + f" (changed: {', '.join(result.candidate.changed_paths) or 'nothing'}). The next attempt is judged "
             "with a fresh seed.", "", "## Verdicts"]
    for v in result.verdicts:
        lines.append(f"- {v.guard}: {v.status.value}: {v.summary}")
    failed = [v for v in result.verdicts if v.status in (Status.FAIL, Status.ERROR)]
    if failed:
        lines += ["", "## What failed"]
        for v in failed:
            lines += [""] + failure_block(result, v, task)
    bad = result.first_failure()
    if bad is not None:
        lines += ["", f"## Evidence from {bad.guard}"]
        lines += [f"- {_evidence_line(e)}" for e in bad.evidence[:MAX_EVIDENCE]]
    if any(p.verdict in ("regression", "no_gain") for p in result.perf):
        lines += ["", "## Timing"]
        lines += [f"- {_perf_seen(p)}" for p in result.perf]
    causes = {failure_cause(v)[0] for v in failed}
    advice = ("Where the cause is the candidate, reproduce the failure, fix it (never special-case shapes or seeds) "
              "and submit again." if "candidate" in causes else
              "Every failure above points at the environment: reproduce it; if it passes, your code may stand as "
              "it is.")
    lines += ["", "Your files from the last attempt are still in the worktree. " + advice]
    return redact("\n".join(lines), hidden)
