"""Markdown report of a result file (per-configuration tables a reviewer reads first)."""

from __future__ import annotations

from workbench.results import RunResult


def perf_not_judged_note(r: RunResult) -> str:
    """One sentence for a result that is "correct, perf not judged": why, and what would judge it."""
    perf = next((v for v in r.verdicts if v.guard == "perf"), None)
    devices = next((str(e.value) for e in perf.evidence if e.name == "perf_devices"), None) if perf else None
    if devices:
        why = f"the task times it on {devices} only"
        how = (f"judge it there (`workbench verify {r.task_id} --branch {r.candidate.branch} "
               f"--device {devices.split(',')[0].strip()}`)")
    else:
        why = perf.summary.rstrip(".") if perf is not None else "the perf guard did not run"
        why, how = why[:1].lower() + why[1:], "no timed workload judges it as declared"
    return (f"Perf was NOT judged on {r.device} ({why}): correctness and activation passed, but this result "
            f"measures no speedup and claims none; {how} before counting it as faster.")


def render_markdown(r: RunResult) -> str:
    """The report: verdicts, correctness per configuration, perf per configuration, provenance.

    The title is the acceptance label (``ACCEPTED``, ``CORRECT, PERF NOT JUDGED`` or ``REJECTED``); a
    result whose perf was not judged says so again right under the title.
    """
    lines = [f"# {r.task_id}: {r.acceptance_label}", ""]
    if r.acceptance == "correct_perf_not_judged":
        lines += [f"> **{perf_not_judged_note(r)}**", ""]
    lines += [
        f"- candidate: `{r.candidate.source}` ({r.candidate.kind}) on branch `{r.candidate.branch}`",
        f"- base `{r.candidate.base_commit[:12]}` -> candidate `{r.candidate.candidate_commit[:12]}`",
        *([f"- baseline: {r.candidate.set_aside} (not queued for review)"] if r.candidate.set_aside else []),
        f"- device: {r.device}; torch {r.environment.get('torch')}; python {r.environment.get('python')}"
        + (f"; GPU {r.environment.get('gpu_name')}" if r.environment.get("gpu_name") else ""),
        f"- started {r.started_at}, took {r.duration_s:.1f} s",
        f"- seed: {r.seed if r.seed is not None else 'not recorded (schema-1 result file)'}",
        f"- reproduce: `{r.command}`",
        *([f"- judging {r.judging} of this exact code: pooled with {', '.join(r.pooled_from)}"]
          if r.judging > 1 else []),
        "",
        "## Verdicts",
        "",
        "| guard | status | summary | time (s) |",
        "|---|---|---|---|",
    ]
    for v in r.verdicts:
        lines.append(f"| {v.guard} | {v.status.value} | {v.summary.replace('|', '/')} | {v.duration_s:.2f} |")
    fail = r.first_failure()
    if fail and fail.evidence:
        lines += ["", f"### Evidence ({fail.guard})", ""]
        for e in fail.evidence[:20]:
            unit = f" {e.unit}" if e.unit else ""
            where = f" at `{e.path}`" if e.path else ""
            lines.append(f"- {e.name}: {str(e.value)[:300]}{unit}{where}")
    if r.cases:
        lines += ["", "## Correctness per configuration", "", "| case | axes | input case | implementation | result |",
                  "|---|---|---|---|---|"]
        for c in r.cases:
            axes = " ".join(f"{k}={v}" for k, v in c.axes.items())
            res = "ok" if c.passed else f"FAIL: {c.mismatches[0][:120].replace('|', '/')}" if c.mismatches else "FAIL"
            lines.append(f"| {c.name} | {axes} | {c.case} | {c.implementation} | {res} |")
    if r.perf:
        lines += ["", "## Performance per configuration (median per call)", "",
                  "| case | axes | baseline (us) | candidate (us) | speedup | CI | p(slower) | verdict |",
                  "|---|---|---|---|---|---|---|---|"]
        for p in r.perf:
            axes = " ".join(f"{k}={v}" for k, v in p.axes.items())
            lines.append(
                f"| {p.name} | {axes} | {p.baseline_median_us:.1f} | {p.candidate_median_us:.1f} | "
                f"{p.speedup:.3f}x | [{p.speedup_ci[0]:.3f}, {p.speedup_ci[1]:.3f}] | {p.p_slower:.3g} | {p.verdict} |")
        if any(p.verdict == "neutral" for p in r.perf):
            lines += ["", "`neutral`: judged for regressions only (a random draw, or a merged base kernel's configuration the "
                      "candidate does not claim) and none found; a speedup there is reported, never required."]
    if r.candidate.changed_paths:
        lines += ["", "## Changed paths", ""] + [f"- `{p}`" for p in r.candidate.changed_paths]
    return "\n".join(lines) + "\n"
