"""A/A of the perf guard's call servers: two serve children of the same tree, both on the standard path of
``k3_small_m_gemm``, timed by the judge on the same inputs (``guards.judge.time_workload``), with and without
the children's fixed glibc allocator thresholds (``guards.sandbox.CHILD_MALLOC_ENV``). Every trial is a fresh
pair of processes; any verdict but ``neutral`` is a false alarm of the guard's rule (``guards.perf.classify``).

    python bench/perf_aa_children.py OUT.json [--trials 6] [--repetitions 120]

Writes ``OUT`` (JSON, with the environment): per setting and workload, every trial's speedup, interval,
Wilcoxon p and verdict.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guards import sandbox  # noqa: E402
from guards.cases import build_case, perf_inputs  # noqa: E402
from guards.judge import call_server, time_workload  # noqa: E402
from guards.perf import _served_spec, classify  # noqa: E402
from workbench import env as envmod  # noqa: E402
from workbench.taskspec import load_task  # noqa: E402

WORKLOADS = {"tiny_m3": {"M": 3, "Q": 1, "N": 256, "K": 1536}, "gemv_n12448": {"M": 1, "Q": 1, "N": 12448, "K": 256}}
"""The two run-time domain draws the landing CI runs flagged (sessions 23 and 24): below the lean kernel's oneDNN
sizes, where a kernel runs the standard path's ``torch.mm``."""


def trial(task, cases, specs, repetitions: int) -> dict:
    req = {"target": task.target, "op": task.op, "device": "cpu", "decode_backend": "standard"}
    sessions: list = []
    out = {}
    with contextlib.ExitStack() as st:
        a = st.enter_context(call_server(ROOT, req, specs, device="cpu", timeout_s=600, memory_bytes=8 << 30,
                                         sessions=sessions))
        b = st.enter_context(call_server(ROOT, req, specs, device="cpu", timeout_s=600, memory_bytes=8 << 30,
                                         sessions=sessions))
        for i, c in enumerate(cases):
            rec = time_workload({"baseline": a, "candidate": b}, i, specs[i],
                                lambda j, c=c: perf_inputs(task, c.workload, 1, j), device="cpu", warmup=5,
                                repetitions=repetitions)
            p = task.perf
            s = classify(rec["baseline"].cpu_us, rec["candidate"].cpu_us, claimed=False,
                         max_regression_pct=p.max_regression_pct, min_speedup=p.min_speedup, confidence=p.confidence,
                         alpha=p.alpha)
            out[c.name] = {"speedup": round(s["speedup"], 4), "ci": [round(x, 4) for x in s["speedup_ci"]],
                           "p_slower": round(s["p_slower"], 4), "verdict": str(s["verdict"].value),
                           "median_us": [round(statistics.median(rec[k].cpu_us), 1) for k in ("baseline", "candidate")]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--repetitions", type=int, default=120)
    args = ap.parse_args()
    task = load_task(ROOT, "k3_small_m_gemm")
    tmpl = task.workload("k3_qkv_a_m8")
    ws = [tmpl.model_copy(update={"name": n, "axes": {**tmpl.axes, **ax}}) for n, ax in WORKLOADS.items()]
    cases = [build_case(task, w, 1) for w in ws]
    specs = [_served_spec(c) for c in cases]
    fixed = dict(sandbox.CHILD_MALLOC_ENV)
    settings = {}
    for name, env in (("glibc_default", {}), ("fixed_thresholds", fixed)):
        sandbox.CHILD_MALLOC_ENV = env
        runs = []
        for t in range(args.trials):
            runs.append(trial(task, cases, specs, args.repetitions))
            print(name, t, runs[-1], flush=True)
        settings[name] = {"child_env": env, "trials": runs,
                          "false_alarms": {w: sum(r[w]["verdict"] != "neutral" for r in runs) for w in WORKLOADS},
                          "ci_excludes_1": {w: sum(r[w]["ci"][0] > 1 or r[w]["ci"][1] < 1 for r in runs) for w in WORKLOADS}}
    sandbox.CHILD_MALLOC_ENV = fixed
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "bench": "perf_aa_children", "what": __doc__.splitlines()[0], "workloads": WORKLOADS,
        "repetitions": args.repetitions, "warmup": 5, "thresholds": {"max_regression_pct": task.perf.max_regression_pct,
                                                                     "alpha": task.perf.alpha},
        "settings": settings, "environment": envmod.collect("cpu")}, indent=1) + "\n")


if __name__ == "__main__":
    main()
