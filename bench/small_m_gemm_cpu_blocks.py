"""CPU sweep of the k3_small_m_gemm ``lean-torch-cpu`` fixture's options, on the machine it runs on.

Session 19's fixture streamed W in row blocks of ``BLOCK_N`` output features (one ``torch.mm``, MKL's
sgemm, per block) instead of one ``torch.mm`` over the whole weight. Which block size pays depends on the
CPU and its BLAS (256 gained 1.26-1.31x on an AMX Xeon and lost 2-9% on an AMD EPYC). The other option
is oneDNN's fp32 matmul on the dense tensors (``torch.ops.mkldnn._linear_pointwise``: no weight prepack,
so nothing is cached between calls). This script times, single-threaded as the perf guard's CPU child
runs, one ``torch.mm`` (the standard path) against each block size and oneDNN, at the task's perf shapes
and K3's other decode projections, interleaved, and writes the per-shape speedups (median of per-pair
ratios, with a 99% distribution-free order-statistic interval), each variant's worst error as a fraction
of the task's tolerance bound, and the CPU's identity.

Usage (repository root): ``python3 bench/small_m_gemm_cpu_blocks.py OUT.json [reps]``.
Source: tasks/k3_small_m_gemm/task.toml ([perf] workloads, shapes); guards/perf.py (interleaved pairs,
median of ratios).
"""

from __future__ import annotations

import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

SHAPES = [(8, 2112, 7168), (16, 2112, 7168), (4, 1536, 7168), (2, 2304, 1536), (8, 2304, 1536), (2, 2112, 7168)]
"""(M, N, K): the task's perf workloads (M 8 and 16 at K3's fused_qkv_a) and K3's other TP8 decode projections."""
BLOCKS = [0, 256, 384, 512, 640, 768, 1056, -1]
"""BLOCK_N values timed; 0 is one torch.mm (the standard path), -1 oneDNN's matmul (reported as ``onednn``)."""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _interval(ratios: list[float]) -> tuple[float, float]:
    """Distribution-free 99% interval of the median (order statistics of the sorted ratios)."""
    r = sorted(ratios)
    n = len(r)
    half = 2.576 * math.sqrt(n) / 2
    lo, hi = max(0, int(n / 2 - half)), min(n - 1, int(math.ceil(n / 2 + half)))
    return r[lo], r[hi]


def main(out: str, reps: int = 40) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows = []
    for M, N, K in SHAPES:
        x = torch.randn(M, K)
        w = torch.randn(N, K) * 0.02
        out_t = torch.empty(M, N)

        def call(block: int, x=x, w=w, out_t=out_t, N=N) -> float:
            t0 = time.perf_counter_ns()
            if block == 0:
                torch.mm(x, w.t(), out=out_t)
            elif block < 0:
                out_t.copy_(torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""))
            else:
                for n0 in range(0, N, block):
                    torch.mm(x, w[n0:n0 + block].t(), out=out_t[:, n0:n0 + block])
            return (time.perf_counter_ns() - t0) / 1e3

        for b in BLOCKS:
            for _ in range(3):
                call(b)
        samples: dict[int, list[float]] = {b: [] for b in BLOCKS}
        for _ in range(reps):
            for b in BLOCKS:
                samples[b].append(call(b))
        base = samples[0]
        xd, wd = x.double(), w.double()
        ref = xd @ wd.t()
        bound = 2.0 ** -22 * ref.abs() + 2.0 ** -22 * math.sqrt(K) * (xd.abs() @ wd.abs().t())
        row = {"M": M, "N": N, "K": K, "standard_us": statistics.median(base), "blocks": {}}
        for b in BLOCKS[1:]:
            ratios = [s / c for s, c in zip(base, samples[b], strict=True)]
            lo, hi = _interval(ratios)
            call(b)
            err = float(((out_t.double() - ref).abs() / bound).max())
            row["blocks"]["onednn" if b < 0 else str(b)] = {"median_us": statistics.median(samples[b]),
                                                            "speedup": statistics.median(ratios), "ci99": [lo, hi],
                                                            "err_over_bound": err}
        rows.append(row)
        best = max(row["blocks"].items(), key=lambda kv: kv[1]["speedup"])
        print(f"({M}, {N}, {K}) standard {row['standard_us']:.0f} us; "
              + " ".join(f"{b}:{v['speedup']:.2f}x" for b, v in row["blocks"].items()) + f"; best {best[0]}", flush=True)
    env = {"cpu_model": _cpu_model(), "torch": torch.__version__, "python": platform.python_version(),
           "threads": torch.get_num_threads(), "blas": "mkl" if torch.backends.mkl.is_available() else "other",
           "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "onednn": torch.backends.mkldnn.is_available(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(out).write_text(json.dumps({"environment": env, "reps": reps, "rows": rows}, indent=1) + "\n")
    print(json.dumps(env))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
