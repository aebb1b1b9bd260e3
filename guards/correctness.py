"""Correctness guard: the candidate matches the reference on every configuration of the task.

Cases = the task's workloads plus random draws inside the declared scope (seeded at run time, never
shown to the candidate). Each case is called three times in a child process: fresh buffers;
the same buffers refilled with other data (an output cache keyed by pointer returns stale data);
fresh buffers again (a moving result is a race). Outputs are poisoned before each call, inputs must
be unchanged after it, and outputs are compared in this process against ``reference.py`` with the
task's ``check`` (or per-output tolerances when the task has none).

Source: issue 2 guard 2; DESIGN.md "Trust model".
"""

from __future__ import annotations

from typing import Any

from guards.base import GuardContext
from guards.cases import Case, correctness_cases, load_task_module
from guards.sandbox import run_child
from guards.verdict import Evidence, Status, Verdict

MAX_MISMATCH_LINES = 8


def generic_check(task, got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    """Per-output comparison from the task's tolerances (exact or allclose)."""
    import torch

    out = []
    for name, tol in task.correctness.tolerance.items():
        g, w = got.get(name), want[name]
        if not isinstance(g, torch.Tensor) or g.shape != w.shape or g.dtype != w.dtype:
            out.append(f"{name}: expected {tuple(w.shape)} {w.dtype}, got {getattr(g, 'shape', None)} {getattr(g, 'dtype', None)}")
            continue
        ok = torch.equal(g, w) if tol.exact else torch.allclose(g.float(), w.float(), rtol=tol.rtol, atol=tol.atol)
        if not ok:
            out.append(f"{name}: differs from the reference (tolerance: {tol.source})")
    return out


def _clip(text: str, n: int) -> str:
    """One sentence: at most ``n`` characters, exactly one final period."""
    text = " ".join(text.split()).rstrip(".")
    return (text[: n - 3] + "..." if len(text) > n else text) + "."


def _inputs_changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    import torch

    bad = []
    for k, v in before.items():
        a = after.get(k)
        if not isinstance(a, torch.Tensor) or a.shape != v.shape or a.dtype != v.dtype or not torch.equal(
            torch.nan_to_num(a.float()) if a.is_floating_point() else a,
            torch.nan_to_num(v.float()) if v.is_floating_point() else v,
        ):
            bad.append(k)
    return bad


class CorrectnessGuard:
    """Runs the candidate's op through the dispatcher in a child and checks every output."""

    name = "correctness"

    def check(self, ctx: GuardContext) -> Verdict:
        task = ctx.task
        ref = load_task_module(task, "reference")
        cases: list[Case] = correctness_cases(task, ctx.seed)
        request = {
            "mode": "correctness",
            "target": task.target,
            "op": task.op,
            "device": ctx.device,
            "decode_backend": "latency_specialized",
            "cases": [c.request_entry() for c in cases],
        }
        outcome = run_child(
            ctx.worktree, request, timeout_s=task.timeouts.correctness_s,
            memory_bytes=task.timeouts.memory_bytes, device=ctx.device,
        )
        if outcome.response is None or not outcome.response.get("ok"):
            why = outcome.problem or str(outcome.response.get("error", "")).strip().splitlines()[0]
            return Verdict(
                guard=self.name, status=Status.FAIL,
                summary=f"The candidate's code did not complete: {_clip(why, 400)}",
                evidence=(
                    Evidence(name="child_problem", value=why),
                    Evidence(name="child_duration", value=round(outcome.duration_s, 2), unit="s"),
                    Evidence(name="stderr_tail", value=outcome.stderr_tail[-1500:]),
                    *( [Evidence(name="child_error", value=str(outcome.response.get("error"))[-2000:])] if outcome.response else [] ),
                ),
            )
        resp = outcome.response
        ctx.artifacts["scope"] = resp.get("scope")
        ctx.artifacts["imported_files"] = [f for f in resp.get("imported_files", []) if isinstance(f, str)]
        by_name = {c.get("name"): c for c in resp.get("cases", []) if isinstance(c, dict)}
        case_results, failures, traces = [], [], {}
        for case in cases:
            rc = by_name.get(case.name)
            mism: list[str] = []
            impls: list[str] = []
            call_traces = []
            if rc is None or len(rc.get("calls", [])) != 3:
                mism.append("the child returned no result for this case")
            else:
                want_a = ref.reference({k: v.clone() for k, v in case.inputs_a.items()}, dict(case.kwargs))
                want_b = ref.reference({k: v.clone() for k, v in case.inputs_b.items()}, dict(case.kwargs))
                for call, inputs, want in zip(rc["calls"], (case.inputs_a, case.inputs_b, case.inputs_a), (want_a, want_b, want_a)):
                    label = call.get("label", "?")
                    call_traces.append(call.get("trace", []))
                    impls += [d.get("implementation", "?") for d in call.get("trace", []) if d.get("op") == task.op]
                    if call.get("error"):
                        mism.append(f"[{label}] raised {call['error'].splitlines()[0]}")
                        continue
                    changed = _inputs_changed(inputs, call.get("inputs_after", {}))
                    if changed:
                        mism.append(f"[{label}] mutated input(s) {', '.join(changed)}")
                    got = call.get("outputs", {})
                    if hasattr(ref, "check"):
                        lines = ref.check({k: v.clone() for k, v in inputs.items()}, dict(case.kwargs), got, want, task.correctness.tolerance)
                    else:
                        lines = generic_check(task, got, want)
                    mism += [f"[{label}] {m}" for m in lines]
            traces[case.name] = call_traces
            impl = ",".join(sorted(set(impls))) or "none"
            passed = not mism
            case_results.append({
                "name": case.name, "axes": dict(case.workload.axes), "params": dict(case.kwargs),
                "case": case.workload.case, "implementation": impl, "passed": passed,
                "mismatches": tuple(mism[:20]), "calls": 3,
            })
            if not passed:
                failures.append((case, mism))
        ctx.artifacts["cases"] = case_results
        ctx.artifacts["traces"] = traces
        ctx.artifacts["case_objects"] = cases
        n = len(cases)
        if failures:
            case, mism = failures[0]
            ev = [Evidence(name="failed_cases", value=len(failures), unit="count"),
                  Evidence(name="cases", value=n, unit="count")]
            for c, m in failures[:MAX_MISMATCH_LINES]:
                ev.append(Evidence(name="mismatch", value=m[0][:300], path=f"{c.name} {dict(c.workload.axes)}"))
            return Verdict(
                guard=self.name, status=Status.FAIL,
                summary=f"{len(failures)} of {n} configurations wrong; first: {case.name} "
                        f"({task.scope.batch_axis}={case.workload.axes[task.scope.batch_axis]}): {_clip(mism[0], 400)}",
                evidence=tuple(ev),
            )
        return Verdict(
            guard=self.name, status=Status.PASS,
            summary=f"All {n} configurations ({len(task.correctness.workloads)} fixed, "
                    f"{n - len(task.correctness.workloads)} random) match the reference on 3 calls each.",
            evidence=(Evidence(name="cases", value=n, unit="count"),
                      Evidence(name="calls_per_case", value=3, unit="count"),
                      Evidence(name="child_duration", value=round(outcome.duration_s, 2), unit="s")),
        )
