"""Per-call median time (us, one torch thread, CPU) of the standard path and each CPU candidate kernel of a
task (its good fixtures and the honest corpus) at the perf guard's run-time domain draws
(``guards.perf.perf_workloads``) of several seeds: where a candidate would be judged slower than the
standard path once perf times shapes and regimes beyond its listed workloads.

    python bench/perf_domain_sweep.py TASK OUT.json [--seeds N] [--calls N]

The ratios are in-process (no judge children, no per-call harness cost), so they are larger than the
guard's; a ratio below 1.0 here is a regression the guard can see.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from guards.cases import build_case, perf_inputs  # noqa: E402
from guards.perf import perf_workloads  # noqa: E402
from workbench.fixtures import list_fixtures  # noqa: E402
from workbench.taskspec import load_task  # noqa: E402

OP_MODULE = {"k3_moe_dispatch": ("k3_model.ops.moe_dispatch", "moe_route_dispatch_standard", "moe_dispatch"),
             "k3_dspark_verify": ("k3_model.ops.dspark_verify", "dspark_verify_standard", "dspark_verify")}


def _load(path: Path, fn: str):
    spec = importlib.util.spec_from_file_location(f"cand_{abs(hash(str(path)))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, fn)


def candidates(task, op_pkg: str, fn: str) -> dict:
    out = {}
    for fx in list_fixtures(task):
        p = fx.path / "k3_model" / "kernels" / op_pkg / "__init__.py"
        if fx.good and fx.runs_on("cpu") and p.is_file():
            out[f"fixture:{fx.name}"] = _load(p, fn)
    honest = ROOT / "tests" / "exploits" / "honest"
    req = tomllib.loads((honest / "requires.toml").read_text())
    for d in sorted(honest.iterdir()):
        p = d / "k3_model" / "kernels" / op_pkg / "__init__.py"
        r = req.get(d.name, {})
        # CPU candidates only; a known perf rejection (requires.toml) is not expected to pass
        if p.is_file() and "cpu" in r.get("devices", ["cpu"]) and r.get("known_rejection_guard") != "perf":
            out[f"honest:{d.name}"] = _load(p, fn)
    return out


def time_fn(f, inputs, kwargs, specs, calls: int) -> float:
    ts = []
    for i in range(calls):
        inp = inputs[i % len(inputs)]
        outs = {k: torch.empty(s["shape"], dtype=getattr(torch, s["dtype"])) for k, s in specs.items()}
        t = time.perf_counter_ns()
        f(**inp, **kwargs, **outs)
        ts.append(time.perf_counter_ns() - t)
    return statistics.median(ts[calls // 5:]) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("task")
    ap.add_argument("out")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(1)
    task = load_task(ROOT, a.task)
    mod_name, std_name, op_pkg = OP_MODULE[a.task]
    std = getattr(importlib.import_module(mod_name), std_name)
    fns = {"standard": std, **candidates(task, op_pkg, "moe_route_dispatch" if op_pkg == "moe_dispatch" else op_pkg)}
    rows = []
    for seed in range(a.seeds):
        for w in perf_workloads(task, seed)[len(task.perf.workloads):]:
            if not w.name.startswith("random-perf-domain-"):
                continue
            case = build_case(task, w, seed)
            ins = [perf_inputs(task, w, seed, j) for j in range(8)]
            med = {k: time_fn(f, ins, case.kwargs, case.output_specs, a.calls) for k, f in fns.items()}
            row = {"seed": seed, "name": w.name, "axes": w.axes, "params": w.params, "regime": w.case,
                   "median_us": {k: round(v, 1) for k, v in med.items()},
                   "speedup_vs_standard": {k: round(med["standard"] / v, 3) for k, v in med.items() if k != "standard"}}
            rows.append(row)
            worst = min(row["speedup_vs_standard"].items(), key=lambda kv: kv[1])
            print(f"seed {seed} {w.name} {w.axes} {w.case}: worst {worst[0]} {worst[1]}x", flush=True)
    env = {"machine": f"{platform.machine()}, 1 torch thread, os.cpu_count {os.cpu_count()}", "torch": torch.__version__,
           "python": platform.python_version(), "calls": f"{a.calls} per candidate and draw, first fifth dropped, median"}
    worst = {k: min(r["speedup_vs_standard"][k] for r in rows) for k in fns if k != "standard"}
    json.dump({"what": __doc__.splitlines()[0], "task": a.task, "environment": env, "worst_speedup": worst, "rows": rows},
              open(a.out, "w"), indent=1)
    print(json.dumps(worst, indent=1))


if __name__ == "__main__":
    main()
