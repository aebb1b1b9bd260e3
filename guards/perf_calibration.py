"""Calibration of the perf guard on a device: false alarms (A/A) and power (planted slowdowns).

``collect`` (on the device): for every perf workload of a task, many independent trials of the perf
guard's own timing (:func:`kernels.timing.time_interleaved`, the task's warm-up and repetitions),
each pairing the standard path with (a) itself, A/A, and (b) itself made ``p`` percent slower by a
calibrated host busy-wait of ``p`` x its median before each call (the GPU idles for exactly that long,
so the whole call is ``p`` percent slower), for ``p`` in 3 and 10. Conditions rotate trial by trial so
drift hits all of them. Raw samples are kept.

``evaluate`` (anywhere): the guard's regression rule (:func:`guards.perf.classify`: paired slowdown
beyond ``max_regression_pct`` and one-sided Wilcoxon p below ``alpha``) applied to every trial for a grid
of settings; false-alarm rate = A/A trials called a regression, power = planted trials called one. Since
session 24 the guard also asks, short of twice the threshold, for the interval to lie below 1; that only
ever turns a regression into none, so the guard's false alarms are at most what ``evaluate`` reports and
its power at most that too (the calibration files predate the condition).

Usage::

    python -m guards.perf_calibration collect TASK OUT.json [--aa 100 --planted 40]
    python -m guards.perf_calibration collect-judged TASK OUT.json [--device cpu --aa 30 --planted 30]
    python -m guards.perf_calibration evaluate IN.json OUT.json

Source: issue 3 "Perf guard calibration" (power >= 95% at 3% with <= 1% false alarms).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SLOWDOWNS_PCT = (3.0, 10.0)
GRID_MAX_REGRESSION_PCT = (0.5, 1.0, 1.5, 2.0, 3.0, 5.0)
GRID_ALPHA = (0.001, 0.01, 0.05)


def _spin_us(us: float) -> None:
    end = time.perf_counter_ns() + int(us * 1e3)
    while time.perf_counter_ns() < end:
        pass


def collect(root: Path, task_id: str, *, device: str = "cuda", aa_trials: int = 100, planted_trials: int = 40,
            slowdowns_pct: Sequence[float] = SLOWDOWNS_PCT, repetitions: int | None = None,
            checkpoint: Path | None = None) -> dict[str, Any]:
    """Run the trials (see module doc) and return raw samples per configuration and condition.

    Args:
        root: the workbench checkout (its standard path is timed; no candidate code runs).
        task_id: task id; its perf workloads, warm-up and repetitions are used.
        device: ``cuda`` (or ``cpu`` for a dry run).
        aa_trials: A/A trials per configuration (count).
        planted_trials: trials per configuration and planted slowdown (count).
        slowdowns_pct: planted slowdowns (percent of the pilot median).
        repetitions: timed calls per side (default: the task's).
        checkpoint: when given, the data so far is written there (JSON) after each configuration.

    Returns:
        ``{"task_id", "device", "warmup", "repetitions", "configs": [{"name", "axes", "pilot_median_us",
        "trials": {"aa": [...], "slow3": [...], ...}}], "environment"}``; each trial holds
        ``baseline_us``, ``candidate_us`` (microseconds) and the median tails.
    """
    import torch

    from guards.cases import build_case
    from k3_model.dispatch import forward_context
    from kernels.stats import median
    from kernels.timing import time_interleaved
    from workbench import env as envmod
    from workbench.taskspec import load_task

    task = load_task(root, task_id)
    import importlib

    mod_name, fn_name = task.target.split(":")
    op = getattr(importlib.import_module(mod_name), fn_name)
    warmup = task.perf.warmup
    reps = repetitions or task.perf.repetitions
    configs: list[dict[str, Any]] = []
    head = {"schema": "workbench-perf-calibration/1", "task_id": task_id, "device": device, "warmup": warmup,
            "repetitions": reps, "timer": "kernels.timing.time_interleaved (events, L2 flush, interleaved)",
            "planted_by": "host busy-wait of p% of the pilot median before each candidate call",
            "environment": envmod.collect(device)}
    for name in task.perf.workloads:
        w = task.workload(name)
        case = build_case(task, w, seed=99)
        inputs = {k: v.to(device) for k, v in case.inputs_a.items()}

        def make(delay_us: float):
            o = {k: torch.full(s["shape"], s["poison"], dtype=getattr(torch, s["dtype"]), device=device)
                 for k, s in case.output_specs.items()}

            def f() -> None:
                if delay_us:
                    _spin_us(delay_us)
                with forward_context(decode_backend="standard", phase=case.phase, requests=case.requests,
                                     query_len=case.query_len):
                    op(**inputs, **case.kwargs, **o)
            return f

        base = make(0.0)
        pa, pb, _ = time_interleaved(base, make(0.0), device=device, warmup=warmup, repetitions=200)
        pilot = median(pa + pb)
        sides = {"aa": make(0.0), **{f"slow{p:g}": make(pilot * p / 100.0) for p in slowdowns_pct}}
        counts = {"aa": aa_trials, **{f"slow{p:g}": planted_trials for p in slowdowns_pct}}
        trials: dict[str, list] = {k: [] for k in sides}
        rounds = max(counts.values())
        t0 = time.monotonic()
        for i in range(rounds):
            for cond, cand in sides.items():
                if i >= counts[cond]:
                    continue
                d: dict = {}
                a, b, wall = time_interleaved(base, cand, device=device, warmup=warmup, repetitions=reps, details=d)
                tails = {}
                if d.get("baseline_tails_us"):
                    tails = {"baseline_tail_median_us": median(d["baseline_tails_us"]),
                             "candidate_tail_median_us": median(d["candidate_tails_us"])}
                trials[cond].append({"baseline_us": [round(x, 3) for x in a], "candidate_us": [round(x, 3) for x in b],
                                     "wall_s": wall, **tails})
        configs.append({"name": name, "axes": dict(w.axes), "pilot_median_us": pilot,
                        "planted_delay_us": {f"slow{p:g}": pilot * p / 100.0 for p in slowdowns_pct},
                        "seconds": time.monotonic() - t0, "trials": trials})
        if checkpoint is not None:
            Path(checkpoint).write_text(json.dumps({**head, "configs": configs}))
        print(f"calibration {name}: pilot {pilot:.1f} us, {sum(len(v) for v in trials.values())} trials "
              f"in {time.monotonic() - t0:.0f} s", flush=True)
    return {**head, "configs": configs}


_SLOW_KERNEL = '''"""Calibration only: the standard path made slower by a CPU busy-wait of {delay_us} us before each call."""
import time

from k3_model.dispatch import OpScope
from {std_module} import {std_fn}_standard as _std

SCOPE = {scope!r}


def {entry}(*args, **kwargs):
    end = time.perf_counter_ns() + {delay_ns}
    while time.perf_counter_ns() < end:
        pass
    _std(*args, **kwargs)
'''


def collect_judged(root: Path, task_id: str, *, device: str = "cpu", workloads: Sequence[str] | None = None,
                   aa_trials: int = 30, planted_trials: int = 30, slowdowns_pct: Sequence[float] = SLOWDOWNS_PCT,
                   seed: int = 99) -> dict[str, Any]:
    """Calibrate the judge's timing (``guards/judge.py``): A/A and planted slowdowns through real children.

    Four serve-mode children run at once from exports of ``root``'s HEAD: the baseline, an A/A twin,
    and one per planted slowdown, whose kernel busy-waits ``p`` percent of the pilot median (CPU time,
    so the judge's CPU clock sees it) before calling the standard path. Each trial interleaves the
    baseline with one condition through :func:`guards.judge.time_workload` on fresh inputs, exactly as
    the perf guard does. Output has :func:`collect`'s format, so :func:`evaluate` applies.

    Args:
        root: the workbench checkout.
        task_id: the task; its warm-up and repetitions are used.
        device: ``cpu`` or ``cuda``.
        workloads: perf workloads to calibrate (default: the task's first).
        aa_trials, planted_trials: trials per condition (count).
        slowdowns_pct: planted slowdowns (percent of the pilot median).
        seed: input seed.
    """
    import contextlib
    import subprocess
    import tempfile

    from guards.cases import build_case
    from guards.judge import call_server, export_tree, time_workload
    from guards.perf import _input_maker, _served_spec
    from kernels.stats import median
    from workbench import env as envmod
    from workbench.taskspec import load_task

    task = load_task(root, task_id)
    names = list(workloads or task.perf.workloads[:1])
    head_commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True, capture_output=True,
                                 text=True).stdout.strip()
    out_cfgs = []
    for name in names:
        w = task.workload(name)
        case = build_case(task, w, seed)
        spec = _served_spec(case)
        req = {"target": task.target, "op": task.op, "device": device, "decode_backend": "latency_specialized"}
        with tempfile.TemporaryDirectory(prefix="wb-calibration-") as tmp:
            trees = {k: export_tree(root, head_commit, Path(tmp) / k) for k in ("base", "aa")}
            for k in ("base", "aa"):  # no kernel merged in either: both run the standard path
                kdir = trees[k] / "k3_model" / "kernels" / task.op
                if kdir.exists():
                    import shutil

                    shutil.rmtree(kdir)
            sessions: list = []
            with contextlib.ExitStack() as stack:
                srv = {k: stack.enter_context(call_server(trees[k], req, [spec], device=device, timeout_s=7200,
                                                          memory_bytes=task.timeouts.memory_bytes,
                                                          sessions=sessions)) for k in ("base", "aa")}
                pilot_rec = time_workload({"baseline": srv["base"], "candidate": srv["aa"]}, 0, spec,
                                          _input_maker(task, case, seed), device=device, warmup=task.perf.warmup,
                                          repetitions=task.perf.repetitions)
                series = "cpu_us" if device == "cpu" else "wall_us"
                pilot = median(getattr(pilot_rec["baseline"], series))
                std_module, std_fn = task.target.split(":")
                scope = {k: tuple(v) if isinstance(v, list) else v for k, v in task.scope.claim_dict().items()}
                scope.update(devices=(device,), tp_sizes=(1,))
                for p in slowdowns_pct:
                    key = f"slow{p:g}"
                    t = export_tree(root, head_commit, Path(tmp) / key)
                    kdir = t / "k3_model" / "kernels" / task.op
                    kdir.mkdir(parents=True, exist_ok=True)
                    delay = pilot * p / 100.0
                    (kdir / "__init__.py").write_text(_SLOW_KERNEL.format(
                        delay_us=round(delay, 3), delay_ns=int(delay * 1e3), std_module=std_module, std_fn=std_fn,
                        scope=scope, entry=std_fn))
                    os.chmod(kdir, 0o755)
                    os.chmod(kdir / "__init__.py", 0o644)
                    srv[key] = stack.enter_context(call_server(t, req, [spec], device=device, timeout_s=7200,
                                                               memory_bytes=task.timeouts.memory_bytes,
                                                               sessions=sessions))
                counts = {"aa": aa_trials, **{f"slow{p:g}": planted_trials for p in slowdowns_pct}}
                trials: dict[str, list] = {k: [] for k in counts}
                t0 = time.monotonic()
                for i in range(max(counts.values())):
                    for cond, n in counts.items():
                        if i >= n:
                            continue
                        rec = time_workload({"baseline": srv["base"], "candidate": srv[cond]}, 0, spec,
                                            _input_maker(task, case, seed + 1 + i), device=device,
                                            warmup=task.perf.warmup, repetitions=task.perf.repetitions)
                        trials[cond].append({"baseline_us": [round(x, 3) for x in getattr(rec["baseline"], series)],
                                             "candidate_us": [round(x, 3) for x in getattr(rec["candidate"], series)]})
                    print(f"calibration {name}: round {i + 1} done, {time.monotonic() - t0:.0f} s", flush=True)
        out_cfgs.append({"name": name, "axes": dict(w.axes), "pilot_median_us": pilot,
                         "planted_delay_us": {f"slow{p:g}": pilot * p / 100.0 for p in slowdowns_pct},
                         "seconds": time.monotonic() - t0, "trials": trials})
    return {"schema": "workbench-perf-calibration/1", "task_id": task_id, "device": device,
            "warmup": task.perf.warmup, "repetitions": task.perf.repetitions,
            "timer": "guards.judge (child process CPU clock read by the judge)" if device == "cpu"
                     else "guards.judge (the judge's wall clock per call)",
            "planted_by": "busy-wait of p% of the pilot median inside the candidate child's call",
            "environment": envmod.collect(device), "configs": out_cfgs}


def _trial_stats(trial: dict) -> tuple[float, float]:
    """The guard's statistics for one trial (:func:`guards.perf.classify`: median of the per-pair
    ratios baseline / candidate, one-sided Wilcoxon signed-rank p that the candidate is slower)."""
    from kernels.stats import median, wilcoxon_greater

    a, b = trial["baseline_us"], trial["candidate_us"]
    return median([x / y for x, y in zip(a, b)]), wilcoxon_greater(b, a)


def evaluate(data: dict[str, Any], *, grid_pct: Sequence[float] = GRID_MAX_REGRESSION_PCT,
             grid_alpha: Sequence[float] = GRID_ALPHA, current: tuple[float, float] | None = None) -> dict[str, Any]:
    """False-alarm rate and power of the regression rule for each setting of the grid.

    Args:
        data: :func:`collect`'s output.
        grid_pct: ``max_regression_pct`` values to try (percent).
        grid_alpha: ``alpha`` values to try.
        current: the task's own ``(max_regression_pct, alpha)``, reported separately.

    Returns:
        ``{"per_setting": [{"max_regression_pct", "alpha", "false_alarm_rate", "power": {cond: rate},
        "per_config": {...}}], "chosen": the loosest-alpha setting meeting false alarms <= 1% and
        power >= 95% at the smallest slowdown (or None), "tails_us": A/A tail statistics}``.
    """
    stats = {c["name"]: {cond: [_trial_stats(t) for t in ts] for cond, ts in c["trials"].items()}
             for c in data["configs"]}
    conds = sorted({cond for c in stats.values() for cond in c}, key=lambda s: (s != "aa", float(s[4:] or 0)
                                                                                if s != "aa" else 0))
    settings = sorted({*((p, a) for p in grid_pct for a in grid_alpha), *([current] if current else [])})
    out = []
    for pct, alpha in settings:
        per_config, totals = {}, {c: [0, 0] for c in conds}
        for name, by_cond in stats.items():
            per_config[name] = {}
            for cond, vals in by_cond.items():
                hits = sum(1 for sp, p in vals if sp < 1.0 / (1.0 + pct / 100.0) and p < alpha)
                per_config[name][cond] = hits / len(vals) if vals else None
                totals[cond][0] += hits
                totals[cond][1] += len(vals)
        rates = {c: (h / n if n else None) for c, (h, n) in totals.items()}
        out.append({"max_regression_pct": pct, "alpha": alpha, "false_alarm_rate": rates.get("aa"),
                    "power": {c: r for c, r in rates.items() if c != "aa"}, "trials": {c: n for c, (_, n) in totals.items()},
                    "per_config": per_config, "is_task_setting": (pct, alpha) == current})
    smallest = next((c for c in conds if c != "aa"), None)
    ok = [s for s in out if s["false_alarm_rate"] is not None and s["false_alarm_rate"] <= 0.01
          and smallest and (s["power"].get(smallest) or 0) >= 0.95]
    chosen = max(ok, key=lambda s: (s["power"].get(smallest, 0), -s["false_alarm_rate"], s["max_regression_pct"]),
                 default=None)
    tails = [t.get("candidate_tail_median_us", 0) - t.get("baseline_tail_median_us", 0)
             for c in data["configs"] for t in c["trials"].get("aa", []) if "baseline_tail_median_us" in t]
    speed_aa = sorted(sp for c in stats.values() for sp, _ in c.get("aa", []))
    return {"per_setting": out, "chosen": chosen, "target": {"false_alarm_max": 0.01, "power_min": 0.95,
                                                             "at_slowdown": smallest},
            "aa_median_ratio_quantiles": {q: speed_aa[min(len(speed_aa) - 1, int(q * len(speed_aa)))]
                                          for q in (0.005, 0.025, 0.5, 0.975, 0.995)} if speed_aa else {},
            "aa_tail_excess_us": {"max": max(tails), "min": min(tails), "n": len(tails)} if tails else None}


def main(argv: list[str]) -> int:
    """CLI (see module doc)."""
    if len(argv) >= 3 and argv[0] == "collect":
        kw = {}
        if "--aa" in argv:
            kw["aa_trials"] = int(argv[argv.index("--aa") + 1])
        if "--planted" in argv:
            kw["planted_trials"] = int(argv[argv.index("--planted") + 1])
        dev = argv[argv.index("--device") + 1] if "--device" in argv else "cuda"
        data = collect(Path.cwd(), argv[1], device=dev, checkpoint=Path(argv[2]), **kw)
        Path(argv[2]).write_text(json.dumps(data))
        return 0
    if len(argv) >= 3 and argv[0] == "collect-judged":
        kw = {}
        if "--aa" in argv:
            kw["aa_trials"] = int(argv[argv.index("--aa") + 1])
        if "--planted" in argv:
            kw["planted_trials"] = int(argv[argv.index("--planted") + 1])
        if "--workload" in argv:
            kw["workloads"] = [argv[argv.index("--workload") + 1]]
        dev = argv[argv.index("--device") + 1] if "--device" in argv else "cpu"
        data = collect_judged(Path.cwd(), argv[1], device=dev, **kw)
        Path(argv[2]).write_text(json.dumps(data))
        return 0
    if len(argv) == 3 and argv[0] == "evaluate":
        from workbench.taskspec import load_task

        data = json.loads(Path(argv[1]).read_text())
        perf = load_task(Path.cwd(), data["task_id"]).perf
        res = evaluate(data, current=(perf.max_regression_pct, perf.alpha))
        summary = {k: v for k, v in data.items() if k != "configs"}
        summary["configs"] = [{k: v for k, v in c.items() if k != "trials"} for c in data["configs"]]
        Path(argv[2]).write_text(json.dumps({**summary, "evaluation": res}, indent=1))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
