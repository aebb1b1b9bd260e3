"""CPU timing of a row task's ``lean-torch-cpu`` kernel against the standard path at decode and
verification-step rows (issue 21: a verification step of R requests at D = 7 drafts is 8R token rows).

Times, single-threaded as the perf guard's CPU child runs, interleaved calls of the standard path and of the
lean kernel on the same inputs (the task's generator, its template workload's case) at K3's sizes and
K3-mini's, for the rows of :data:`TASKS`; writes the per-shape speedup (median of per-pair ratios, with a
99% distribution-free order-statistic interval) and the CPU's identity. A lean kernel's ``rows_max`` (the
most rows its scope claims) comes from where this gain ends.

Usage (repository root): ``python3 bench/verification_rows.py TASK OUT.json [reps]`` (TASK: k3_moe_dispatch,
k3_lse_merge).
Source: tasks/<TASK>/task.toml (workloads, generator); guards/perf.py (interleaved pairs, median of
ratios); kernel_targets.md §2.4 (D = 7).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guards.cases import build_case  # noqa: E402
from workbench.taskspec import load_task  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from small_m_gemm_cpu_blocks import _cpu_model, _interval  # noqa: E402  (the CPU's name; the median's 99% interval)

TASKS = {
    "k3_moe_dispatch": {
        "standard": "k3_model.ops.moe_dispatch:moe_route_dispatch_standard", "entry": "moe_route_dispatch",
        "template": "k3_t8", "rows_axis": "T",
        # token rows: decode (1, 64) and verification steps of 1, 8, 16, 24, 32 and 64 requests at D = 7
        "sizes": {"k3": ({"E": 896, "K": 16}, (1, 8, 64, 128, 192, 256, 512)),
                  "mini": ({"E": 32, "K": 4}, (1, 8, 64, 128, 192, 256, 512))},
    },
    "k3_lse_merge": {
        "standard": "k3_model.ops.lse_merge:lse_merge_standard", "entry": "lse_merge",
        "template": "k3_n4_b8", "rows_axis": "B",
        # K3 (96 heads) up to 16 verifying requests (N = 4 pages: 25M elements at 128 rows); K3-mini (4 heads) to 64
        "sizes": {"k3": ({"N": 4, "H": 96, "D": 512}, (1, 8, 64, 128)),
                  "mini": ({"N": 9, "H": 4, "D": 512}, (1, 8, 64, 128, 512))},
    },
}
"""Per task: the standard path, the lean kernel's entry, the template workload, the rows axis and, per size
name, the fixed axes and the rows timed (query length 8 above one row)."""


def main(task_id: str, out: Path, reps: int = 60) -> None:
    cfg = TASKS[task_id]
    torch.set_num_threads(1)
    task = load_task(ROOT, task_id)
    path = ROOT / "tasks" / task_id / "fixtures/good/lean-torch-cpu/k3_model/kernels" / task.op / "__init__.py"
    spec = importlib.util.spec_from_file_location(f"lean_{task.op}", path)
    lean = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lean)
    mod, name = cfg["standard"].split(":")
    standard = getattr(importlib.import_module(mod), name)
    tmpl = task.workload(cfg["template"])
    rows = []
    for size, (fixed, timed_rows) in cfg["sizes"].items():
        for T in timed_rows:
            q = 8 if T > 1 else 1
            axes = {**tmpl.axes, **fixed, cfg["rows_axis"]: T, "Q": q}
            w = tmpl.model_copy(update={"name": f"bench-{size}-{T}", "axes": axes})
            case = build_case(task, w, seed=1234 + T)
            o = {k: torch.empty(s["shape"], dtype=getattr(torch, s["dtype"])) for k, s in case.output_specs.items()}
            fns = {"standard": standard, "lean": getattr(lean, cfg["entry"])}
            for fn in fns.values():
                for _ in range(5):
                    fn(**case.inputs_a, **case.kwargs, **o)
            ratios, med = [], {k: [] for k in fns}
            for _ in range(reps):
                t = {}
                for k, fn in fns.items():
                    t0 = time.thread_time_ns()
                    fn(**case.inputs_a, **case.kwargs, **o)
                    t[k] = (time.thread_time_ns() - t0) / 1e3
                    med[k].append(t[k])
                ratios.append(t["standard"] / t["lean"])
            lo, hi = _interval(ratios)
            row = {"size": size, "rows": T, "query_len": q, "standard_us": statistics.median(med["standard"]),
                   "lean_us": statistics.median(med["lean"]), "speedup": statistics.median(ratios),
                   "speedup_99ci": [lo, hi]}
            rows.append(row)
            print(f"{size:5s} rows {T:4d}  standard {row['standard_us']:8.1f} us  lean {row['lean_us']:8.1f} us  "
                  f"{row['speedup']:.2f}x [{lo:.2f}, {hi:.2f}]", flush=True)
    env = {"task": task_id, "cpu": _cpu_model(), "cores": torch.get_num_threads(), "torch": torch.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "reps": reps,
           "timer": "thread CPU time, one thread, standard and lean interleaved per repetition"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 60)
