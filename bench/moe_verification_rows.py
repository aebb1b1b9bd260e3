"""CPU timing of the k3_moe_dispatch ``lean-torch-cpu`` kernel against the standard path at decode and
verification-step rows (issue 21: a verification step of R requests at D = 7 drafts is 8R token rows).

Times, single-threaded as the perf guard's CPU child runs, interleaved calls of the standard path and of the
lean kernel on the same inputs (the task's generator, realistic regime) at K3's sizes (E = 896, top-16) and
K3-mini's (E = 32, top-4), for token rows 1-512; writes the per-shape speedup (median of per-pair ratios,
with a 99% distribution-free order-statistic interval) and the CPU's identity. The lean kernel's
``rows_max`` (the most rows its scope claims) comes from where this gain ends.

Usage (repository root): ``python3 bench/moe_verification_rows.py OUT.json [reps]``.
Source: tasks/k3_moe_dispatch/task.toml (workloads, generator); guards/perf.py (interleaved pairs, median of
ratios); kernel_targets.md §2.4 (D = 7).
"""

from __future__ import annotations

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
from k3_model.ops.moe_dispatch import moe_route_dispatch_standard  # noqa: E402
from workbench.taskspec import load_task  # noqa: E402

sys.path.insert(0, str(ROOT / "bench"))
from small_m_gemm_cpu_blocks import _cpu_model, _interval  # noqa: E402  (the CPU's name; the median's 99% interval)

LEAN = ROOT / "tasks/k3_moe_dispatch/fixtures/good/lean-torch-cpu/k3_model/kernels/moe_dispatch/__init__.py"
ROWS = (1, 8, 64, 128, 192, 256, 512)
"""Token rows timed: decode (1, 64) and verification steps of 1, 8, 16, 24, 32 and 64 requests at D = 7."""
SIZES = {"k3": {"E": 896, "K": 16}, "mini": {"E": 32, "K": 4}}


def main(out: Path, reps: int = 60) -> None:
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("lean_moe", LEAN)
    lean = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lean)
    task = load_task(ROOT, "k3_moe_dispatch")
    tmpl = task.workload("k3_t8")
    rows = []
    for size, ek in SIZES.items():
        for T in ROWS:
            q = 8 if T > 1 else 1
            w = tmpl.model_copy(update={"name": f"bench-{size}-{T}", "axes": {**tmpl.axes, **ek, "T": T, "Q": q}})
            case = build_case(task, w, seed=1234 + T)
            o = {k: torch.empty(s["shape"], dtype=getattr(torch, s["dtype"])) for k, s in case.output_specs.items()}
            fns = {"standard": moe_route_dispatch_standard, "lean": lean.moe_route_dispatch}
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
    env = {"cpu": _cpu_model(), "cores": torch.get_num_threads(), "torch": torch.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "reps": reps,
           "timer": "thread CPU time, one thread, standard and lean interleaved per repetition"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 60)
