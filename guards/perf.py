"""Perf guard: no regression at any configuration, a real gain where the candidate claims its path.

Baseline = what the base commit runs: the standard path, or the kernel already merged for the op where
its scope covers the configuration (a candidate replacing a merged kernel must beat that kernel);
candidate = the dispatcher with ``decode_backend=latency_specialized``,
same inputs, same child process, interleaved A B A B after warm-up. Per configuration: medians, a
bootstrap interval of the per-pair speedup (baseline / candidate), and a one-sided Wilcoxon
signed-rank test that the candidate is slower. A regression is a slowdown beyond ``max_regression_pct`` that is significant at
``alpha``; inside the claimed scope the speedup must reach ``min_speedup`` with the interval's lower
bound above 1. On CPU the timer is the CPU clock (the mechanism is what CI tests); on CUDA events.

Source: issue 2 guard 4; kernels/stats.py for the statistics.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import random

from guards.activation import claims
from guards.base import GuardContext
from guards.cases import build_case, load_task_module, perf_rotation
from guards.sandbox import run_child
from guards.verdict import Evidence, Status, Verdict
from kernels.stats import median, paired_ratio_ci, wilcoxon_greater

WALL_SLACK = 1.05
"""Timed samples may not add up to more than the loop's wall clock (x this slack for timer overhead)."""
MIN_SAMPLE_WALL_RATIO_CUDA = 0.5
"""CUDA: lowest median of (event sample / host wall clock of the same call) per side (ratio). The events
bracket the call and a device-wide synchronize, so an honest sample is not much shorter than the call."""
MIN_SIDE_RATIO_CPU = 0.7
"""CPU: lowest ratio between the two sides' medians of (sample / wall clock of the same call). The CPU
timer is the thread's CPU clock, which load from other processes can push below the wall clock, but
equally for both interleaved sides; a timer that shrinks one side only breaks the balance."""
MAX_SAMPLE_WALL_RATIO_CPU = 1.5
"""CPU: a thread's CPU time cannot exceed the wall clock of the same call (ratio, with timer overhead)."""
OUTPUT_CHECKS = 4
"""Timed candidate calls (chosen at random after the run) whose outputs are checked against the reference."""


def _median_ratio(samples_us, wall_us) -> float | None:
    n = len(samples_us)
    if n == 0 or len(wall_us) < n:
        return None
    ratios = sorted(s / w for s, w in zip(samples_us, wall_us[-n:]) if w > 0)
    return ratios[len(ratios) // 2] if ratios else None


def timing_tampering(base_us, base_wall_us, cand_us, cand_wall_us, *, device: str) -> str | None:
    """Why the timer's samples cannot be trusted, or ``None``.

    Args:
        base_us, cand_us: the timer's per-call samples of each side (microseconds).
        base_wall_us, cand_wall_us: the wall clock of that side's own calls (microseconds), measured in
            the child with a clock bound before candidate code ran; the last ``len(samples)`` are the
            timed calls.
        device: ``cpu`` or ``cuda``.

    Returns:
        One sentence when the samples disagree with the wall clock of the calls they time, else ``None``
        (also when the child returned too few wall-clock readings to compare).
    """
    rb, rc = _median_ratio(base_us, base_wall_us), _median_ratio(cand_us, cand_wall_us)
    if rb is None or rc is None:
        return None
    if device == "cuda":
        for side, r in (("baseline", rb), ("candidate", rc)):
            if r < MIN_SAMPLE_WALL_RATIO_CUDA:
                return (f"{side} samples are {r:.2f}x the wall clock of the same calls "
                        f"(at least {MIN_SAMPLE_WALL_RATIO_CUDA} expected): timer tampering")
        return None
    for side, r in (("baseline", rb), ("candidate", rc)):
        if r > MAX_SAMPLE_WALL_RATIO_CPU:
            return f"{side} samples are {r:.2f}x the wall clock of the same calls: timer tampering"
    lo, hi = min(rb, rc), max(rb, rc)
    if hi > 0 and lo / hi < MIN_SIDE_RATIO_CPU:
        return (f"sample/wall-clock ratio is {rc:.2f} for the candidate and {rb:.2f} for the baseline "
                f"(they must agree within {MIN_SIDE_RATIO_CPU}): timer tampering")
    return None

TAIL_EXCESS_ABS_US = 10.0
TAIL_EXCESS_REL = 0.10
"""CUDA: a candidate whose median tail (end of call to a fence after a device-wide sync) exceeds the
baseline's by more than ``max(TAIL_EXCESS_ABS_US, TAIL_EXCESS_REL x its median)`` left work running
outside its timed window (side stream). Source: kernels/timing.py; the H200 A/A tails in
bench/results/h200/perf_calibration.json (median tail differences within -6.9..+5.9 us over 500 trials)."""


def physical_checks(stats: dict, p: dict) -> dict:
    """Apply the CUDA-only checks to one configuration's statistics (in place) and return them.

    Args:
        stats: :func:`classify`'s dict for the configuration.
        p: the child's perf entry; ``floor_us``, ``baseline_tails_us`` and ``candidate_tails_us`` are
            used when present (CUDA runs).

    Returns:
        ``stats`` with ``floor_us`` and ``tail_excess_us`` set, and ``verdict`` set to ``below_floor``
        (median under the physical floor: impossible, so the timing was subverted) or ``side_stream``
        (work left outside the timed window) when a check fails.
    """
    from kernels.timing import below_floor

    floor = p.get("floor_us")
    stats["floor_us"] = float(floor) if floor is not None else None
    bt, ct = p.get("baseline_tails_us") or [], p.get("candidate_tails_us") or []
    stats["tail_excess_us"] = (median([float(x) for x in ct]) - median([float(x) for x in bt])) if bt and ct else None
    if stats["floor_us"] is not None and below_floor(stats["candidate_median_us"], stats["floor_us"]):
        stats["verdict"] = "below_floor"
    elif stats["tail_excess_us"] is not None and stats["tail_excess_us"] > max(
            TAIL_EXCESS_ABS_US, TAIL_EXCESS_REL * stats["candidate_median_us"]):
        stats["verdict"] = "side_stream"
    return stats


def classify(base_us, cand_us, *, claimed: bool, max_regression_pct: float, min_speedup: float,
             confidence: float, alpha: float, seed: int = 0) -> dict:
    """Statistics and verdict for one configuration, from interleaved pairs.

    The speedup is the median of per-pair ratios baseline[i] / candidate[i] (pairs were timed back to
    back, so load from other processes cancels); its interval is a bootstrap over pairs; the slowdown
    test is a one-sided Wilcoxon signed-rank test on the log ratios.

    Args:
        base_us, cand_us: paired per-call samples (microseconds), same length.
        claimed: the candidate claims its path here (a gain is required).
        max_regression_pct: tolerated slowdown (percent).
        min_speedup: required speedup where claimed (ratio).
        confidence: bootstrap interval level (0-1).
        alpha: significance level of the slowdown test.

    Returns:
        dict with baseline/candidate medians (us), speedup, speedup_ci, p_slower, verdict.

    Source: kernels/stats.py (paired bootstrap, Wilcoxon 1945); thresholds from the task's [perf].
    """
    speedup, (lo, hi) = paired_ratio_ci(base_us, cand_us, confidence=confidence, resamples=1000, seed=seed)
    p_slower = wilcoxon_greater(cand_us, base_us)
    if speedup < 1.0 / (1.0 + max_regression_pct / 100.0) and p_slower < alpha:
        verdict = "regression"
    elif claimed and not (speedup >= min_speedup and lo > 1.0):
        verdict = "no_gain"
    elif claimed:
        verdict = "gain"
    else:
        verdict = "neutral"
    return {"baseline_median_us": median(base_us), "candidate_median_us": median(cand_us), "speedup": speedup,
            "speedup_ci": (lo, hi), "p_slower": p_slower, "verdict": verdict}


class PerfGuard:
    """Times baseline and candidate per perf workload in one child."""

    name = "perf"

    def check(self, ctx: GuardContext) -> Verdict:
        task = ctx.task
        claimed = ctx.artifacts.get("scope")
        if claimed is None:
            raise RuntimeError("perf guard needs the declared scope from the correctness guard")
        if ctx.device not in task.perf.devices:
            return Verdict(guard=self.name, status=Status.SKIP,
                           summary=f"Performance of this task is judged on {', '.join(task.perf.devices)} only, "
                                   f"not {ctx.device}: {task.perf.devices_reason.rstrip('.')}.",
                           evidence=(Evidence(name="perf_devices", value=", ".join(task.perf.devices)),))
        dtype = task.inputs[task.scope.dtype_input].dtype
        cases, claimed_flags = [], {}
        for name in task.perf.workloads:
            w = task.workload(name)
            c = build_case(task, w, ctx.seed)
            cases.append(c)
            claimed_flags[name] = claims(claimed, phase=w.phase, batch=w.axes[task.scope.batch_axis],
                                         device=ctx.device, dtype=dtype, tp=task.world_size(w))
        with tempfile.TemporaryDirectory(prefix="wb-base-kernel-") as tmp:
            base_kernel = extract_base_kernel(ctx.repo_root, ctx.base_commit, task.op, Path(tmp))
            return self._check(ctx, cases, claimed_flags, base_kernel)

    def _check(self, ctx: GuardContext, cases, claimed_flags, base_kernel: Path | None) -> Verdict:
        task = ctx.task
        # With a kernel already merged at the base, the baseline is what the base runs (that kernel where
        # its scope covers the configuration): every perf workload is timed, claimed or not.
        timed = [c for c in cases if claimed_flags[c.name] or base_kernel is not None]
        results = []
        for c in cases:
            if c not in timed:
                results.append({"name": c.name, "axes": dict(c.workload.axes), "implementation": "standard",
                                "baseline_us": (), "candidate_us": (), "baseline_median_us": 0.0,
                                "candidate_median_us": 0.0, "speedup": 1.0, "speedup_ci": (1.0, 1.0),
                                "p_slower": 1.0, "verdict": "not_claimed",
                                "timer": "none (both sides run the standard path)"})
        if timed:
            n_calls = task.perf.warmup + task.perf.repetitions
            rotations = {c.name: perf_rotation(task, c.workload, ctx.seed, n_calls) for c in timed}
            base_req = {"mode": "perf", "target": task.target, "op": task.op, "device": ctx.device,
                        "decode_backend": "latency_specialized",
                        "perf": {"warmup": task.perf.warmup, "repetitions": task.perf.repetitions},
                        "baseline_kernel_dir": str(base_kernel) if base_kernel else None}
            by_name, problem, child_s = _time_cases(ctx, base_req, timed, rotations)
            if problem is not None:
                why, tail = problem
                return Verdict(guard=self.name, status=Status.FAIL,
                               summary=f"Timing run did not complete: {why}.",
                               evidence=(Evidence(name="child_problem", value=why),
                                         Evidence(name="stderr_tail", value=tail[-1500:])))
            timer = "cuda_event" if ctx.device == "cuda" else ("cpu_wall_clock" if task.distributed else "cpu_thread_time")
            total_samples_us = 0.0
            for i, c in enumerate(timed):
                p = by_name.get(c.name)
                if p is None:
                    raise RuntimeError(f"timing child returned nothing for {c.name}")
                base = [float(x) for x in p["baseline_us"]]
                cand = [float(x) for x in p["candidate_us"]]
                impl = ",".join(sorted({d.get("implementation") for d in p.get("trace_candidate", [])})) or "none"
                base_impl = ",".join(sorted({d.get("implementation") for d in p.get("trace_baseline", [])})) or "none"
                if base_kernel is not None and base_impl == "latency_specialized":
                    base_impl = "base kernel"
                max_reg, alpha = task.perf.regression_test(ctx.device)
                stats = classify(base, cand, claimed=claimed_flags[c.name], max_regression_pct=max_reg,
                                 min_speedup=task.perf.min_speedup, confidence=task.perf.confidence,
                                 alpha=alpha, seed=i)
                physical_checks(stats, p)
                if (sum(base) + sum(cand)) > float(p["wall_s"]) * 1e6 * WALL_SLACK:
                    stats["verdict"] = "regression"
                    impl += " (timer samples exceed the wall clock: timer tampering)"
                why = timing_tampering(base, [float(x) for x in p.get("baseline_wall_us", ())],
                                       cand, [float(x) for x in p.get("candidate_wall_us", ())], device=ctx.device)
                if why:
                    stats["verdict"] = "tampered"
                    impl += f" ({why})"
                wrong = _timed_output_problem(task, c, rotations[c.name], p, ctx.seed)
                if wrong:
                    stats["verdict"] = "wrong_output"
                    impl += f" ({wrong})"
                total_samples_us += sum(base) + sum(cand)
                results.append({"name": c.name, "axes": dict(c.workload.axes), "implementation": impl,
                                "baseline_implementation": base_impl,
                                "baseline_us": tuple(base), "candidate_us": tuple(cand), "timer": timer, **stats})
            if total_samples_us > child_s * 1e6:  # the parent's own clock, out of the child's reach
                for r in results:
                    if r.get("timer") == timer:
                        r["verdict"] = "tampered"
                        r["implementation"] += (f" (samples sum to {total_samples_us / 1e6:.2f} s, longer than the "
                                                f"child lived: {child_s:.2f} s)")
        order = {n: i for i, n in enumerate(task.perf.workloads)}
        results.sort(key=lambda r: order[r["name"]])
        ctx.artifacts["perf"] = results
        bad = [r for r in results if r["verdict"] in ("regression", "no_gain", "below_floor", "side_stream",
                                                        "tampered", "wrong_output")]
        table = tuple(
            Evidence(name=f"speedup[{r['name']}]", value=round(r["speedup"], 3), unit="x",
                     path=f"base {r['baseline_median_us']:.1f} us, cand {r['candidate_median_us']:.1f} us, "
                          f"CI [{r['speedup_ci'][0]:.3f}, {r['speedup_ci'][1]:.3f}], {r['verdict']}")
            for r in results)
        if bad:
            r = bad[0]
            what = {"regression": f"slower than the baseline ({r.get('baseline_implementation', 'standard')})",
                    "below_floor": f"faster than physically possible (floor {r.get('floor_us') or 0:.1f} us)",
                    "side_stream": f"leaving work outside its timed window ({r.get('tail_excess_us') or 0:.1f} us "
                                   "longer tail than the baseline)",
                    "tampered": f"timed untrustworthily [{r['implementation']}]",
                    "wrong_output": f"wrong while timed [{r['implementation']}]"}.get(
                r["verdict"], f"no real gain (need >= {task.perf.min_speedup}x with the interval above 1)")
            return Verdict(guard=self.name, status=Status.FAIL,
                           summary=f"{len(bad)} configuration(s) fail; first: {r['name']} is {what}: "
                                   f"{r['speedup']:.3f}x (CI {r['speedup_ci'][0]:.3f}-{r['speedup_ci'][1]:.3f}).",
                           evidence=table)
        if not timed:
            return Verdict(guard=self.name, status=Status.SKIP,
                           summary="No perf workload lies inside the kernel's declared scope on this device.")
        gains = [r["speedup"] for r in results if r["verdict"] == "gain"]
        if not gains:  # only a merged base kernel's configurations outside the claim were timed
            return Verdict(guard=self.name, status=Status.PASS,
                           summary=f"No regression in the {len(results)} timed configuration(s); none is claimed, "
                                   "so no gain is required.", evidence=table)
        return Verdict(guard=self.name, status=Status.PASS,
                       summary=f"Faster in all {len(gains)} claimed configurations "
                               f"({min(gains):.2f}x-{max(gains):.2f}x), no regression anywhere.",
                       evidence=table)


_PER_CALL = ("baseline_us", "candidate_us", "baseline_wall_us", "candidate_wall_us", "baseline_tails_us",
             "candidate_tails_us")


def _merge_ranks(entries: list[dict]) -> dict:
    """One perf entry from every rank's: per call the slowest rank (a collective ends when its last rank does).

    Rank 0's traces and details are kept; ``candidate_outputs`` becomes a list per rank
    (``rank_outputs``) so every rank's timed outputs are checked.
    """
    out = dict(entries[0])
    for key in _PER_CALL:
        cols = [e.get(key) or [] for e in entries]
        if all(cols):
            out[key] = [max(float(x) for x in xs) for xs in zip(*cols)]
    out["wall_s"] = max(float(e["wall_s"]) for e in entries)
    out["rank_outputs"] = [e.get("candidate_outputs") or [] for e in entries]
    return out


def _time_cases(ctx: GuardContext, base_req: dict, timed, rotations) -> tuple[dict, tuple[str, str] | None, float]:
    """Run the timing child (one per TP rank for distributed tasks); returns (entries by name, problem, seconds).

    ``problem`` is (one sentence, stderr tail) when a child did not complete; seconds is the longest
    a child lived, measured here (the parent's clock).
    """
    from guards.cases import rank_inputs
    from guards.sandbox import run_ranks

    task = ctx.task
    if task.distributed is None:
        req = {**base_req, "cases": [{**c.request_entry(), "rotation": rotations[c.name]} for c in timed]}
        outcome = run_child(ctx.worktree, req, timeout_s=task.timeouts.perf_s,
                            memory_bytes=task.timeouts.memory_bytes, device=ctx.device)
        if outcome.response is None or not outcome.response.get("ok"):
            why = outcome.problem or str(outcome.response.get("error", "")).strip().splitlines()[0]
            return {}, (why, outcome.stderr_tail), outcome.duration_s
        return ({p.get("name"): p for p in outcome.response.get("perf", []) if isinstance(p, dict)}, None,
                outcome.duration_s)
    d = task.distributed
    merged, longest = {}, 0.0
    for world in sorted({c.world_size for c in timed}):
        group = [c for c in timed if c.world_size == world]
        reqs = [{**base_req, "cases": [{**c.request_entry(r),
                                         "rotation": [rank_inputs(x, c.per_rank, r) for x in rotations[c.name]]}
                                        for c in group]} for r in range(world)]
        outcomes = run_ranks(ctx.worktree, reqs, backend=d.backend_cuda if ctx.device == "cuda" else d.backend_cpu,
                             collective_timeout_s=d.collective_timeout_s, timeout_s=task.timeouts.perf_s,
                             memory_bytes=task.timeouts.memory_bytes, device=ctx.device)
        longest += max(o.duration_s for o in outcomes)
        for r, o in enumerate(outcomes):
            if o.response is None or not o.response.get("ok"):
                why = o.problem or str(o.response.get("error", "")).strip().splitlines()[0]
                return {}, (f"TP rank {r}: {why}", o.stderr_tail), longest
        per_rank = [{p.get("name"): p for p in o.response.get("perf", []) if isinstance(p, dict)} for o in outcomes]
        for c in group:
            entries = [pr.get(c.name) for pr in per_rank]
            if all(entries):
                merged[c.name] = _merge_ranks(entries)
    return merged, None, longest


def extract_base_kernel(repo_root: Path, base_commit: str, op: str, dest: Path) -> Path | None:
    """Write the base commit's ``k3_model/kernels/<op>/`` package into ``dest``; ``None`` if none is merged.

    The base is reviewed code (what main runs today); the timing child loads it under a private module
    name and swaps it into the dispatcher for the baseline side's calls.
    """
    import git

    tree = git.Repo(repo_root).commit(base_commit).tree
    try:
        sub = tree / f"k3_model/kernels/{op}"
    except KeyError:
        return None
    if not any(b.name == "__init__.py" for b in sub.blobs):
        return None
    out = dest / op
    for item in sub.traverse():
        if item.type != "blob" or item.mode == 0o120000:
            continue
        target = out / Path(item.path).relative_to(sub.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(item.data_stream.read())
    return out


def _timed_output_problem(task, case, rotation, p: dict, seed: int) -> str | None:
    """Check the candidate's outputs of a few timed calls (picked after the run) against the reference.

    A kernel that counts calls and changes behaviour once it is being timed (skips work, replays a
    cache, defers writes) passes the three correctness calls but fails here.

    Returns:
        One sentence naming the first wrong call, or ``None``.
    """
    from guards.correctness import generic_check

    ranks = p.get("rank_outputs") or [p.get("candidate_outputs") or []]
    calls = int((p.get("calls") or {}).get("candidate", 0))
    n = len(rotation)
    for r, outs in enumerate(ranks):
        if len(outs) != n or calls != n:
            return (f"the timing child{f' of rank {r}' if len(ranks) > 1 else ''} returned {len(outs)} output sets "
                    f"for {calls} calls; expected {n} of each")
    ref = load_task_module(task, "reference")
    rng = random.Random(seed ^ 0x5EED)
    timed = range(task.perf.warmup, n)
    picks = sorted(set(rng.sample(list(timed), min(OUTPUT_CHECKS, len(timed)))) | {n - 1})
    for i in picks:
        inputs = rotation[i]
        want = ref.reference({k: v.clone() for k, v in inputs.items()}, dict(case.kwargs))
        for r, outs in enumerate(ranks):
            got = outs[i]
            if hasattr(ref, "check"):
                lines = ref.check({k: v.clone() for k, v in inputs.items()}, dict(case.kwargs), got, want,
                                  task.correctness.tolerance)
            else:
                lines = generic_check(task, got, want)
            if lines:
                where = f" on rank {r}" if len(ranks) > 1 else ""
                return f"outputs of timed call {i - task.perf.warmup}{where} differ from the reference: {lines[0][:160]}"
    return None
