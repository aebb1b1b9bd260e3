"""Session 15's CPU figures, written to a results file: the cost of Python's cyclic garbage collector in
a process that imported torch and the model (full collection vs. collection after ``gc.freeze``, what
the perf child now pays per call), and how many seeds' draws beyond the cost cap reach the LSE fixture
``correctness-wrong-above-the-cost-cap`` (above 2^23 elements, B not a multiple of 8, regime realistic).

Usage: ``python bench/session15_probe.py --out bench/results/cpu/session15_probe.json [--seeds 400]``.
Run from a checkout; ``--label`` names the code measured (e.g. the commit).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from pathlib import Path


def gc_costs(calls: int = 2000) -> dict:
    import torch  # noqa: F401  (the objects a perf child holds)

    import k3_model  # noqa: F401

    gc.collect()
    n_objects = len(gc.get_objects())
    t = time.perf_counter_ns()
    gc.collect()
    full_ms = (time.perf_counter_ns() - t) / 1e6
    gc.freeze()
    gc.disable()
    ts = []
    for _ in range(calls):
        _ = [{}, []]  # a call's ordinary garbage
        t = time.perf_counter_ns()
        gc.collect()
        ts.append((time.perf_counter_ns() - t) / 1e3)
        gc.freeze()
    gc.unfreeze()
    gc.enable()
    return {"tracked_objects": n_objects, "full_collection_ms": round(full_ms, 3),
            "collect_after_freeze_us_median": round(statistics.median(ts), 3),
            "collect_after_freeze_us_p90": round(sorted(ts)[int(0.9 * len(ts))], 3), "calls": calls}


def ceiling_misses(seeds: int) -> dict:
    from guards.cases import beyond_cost_draws
    from workbench.taskspec import load_task

    task = load_task(Path("."), "k3_lse_merge")
    miss = 0
    for s in range(seeds):
        hit = any(a["N"] * a["B"] * a["H"] * a["D"] > 1 << 23 and a["B"] % 8 and case.split("+")[0] == "realistic"
                  and "+" not in case for a, _, case in beyond_cost_draws(task, s))
        miss += not hit
    return {"seeds": seeds, "seeds_missing_the_fixture_condition": miss}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", type=int, default=400)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    import torch

    out = Path(args.out)
    doc = json.loads(out.read_text()) if out.exists() else {}
    doc.setdefault("environment", {"machine": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                                   "torch": torch.__version__, "platform": platform.platform()})
    doc.setdefault("runs", []).append({"label": args.label, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                       "gc": gc_costs(), "beyond_cost": ceiling_misses(args.seeds)})
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["runs"][-1]))


if __name__ == "__main__":
    main()
