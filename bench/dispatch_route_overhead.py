"""What the perf guard's two timed sides pay per call of a tiny op on CPU, by dispatch route.

Times one ``k3_model.ops.small_m_gemm.small_m_gemm`` call inside its forward context, as the perf guard's
child does (``guards/_child_main.py`` ``_perf_case``), interleaved A B A B in this thread's CPU time
(``time.thread_time_ns``), for three sides:

- ``standard backend``: ``decode_backend=standard`` (the TP path's baseline, ``_perf_case``);
- ``no kernel merged``: ``decode_backend=latency_specialized`` with no kernel for the op (the call servers'
  baseline child before session 23: the dispatcher finds nothing merged);
- ``standard routed as a kernel``: ``decode_backend=latency_specialized`` through
  ``k3_model.dispatch.StandardRoutedAsKernel`` with the kernel's ``SCOPE`` (the baseline since session 23);
- ``kernel``: ``decode_backend=latency_specialized`` through the task's ``lean-torch-cpu`` fixture, which
  runs one ``torch.mm`` below its oneDNN sizes (the standard path's computation, plus its own size check).

The shapes are domain draws inside the fixture's claimed rows (2-16) where it takes ``torch.mm``. Each row
gives the medians and the median of per-pair ratios (side / kernel: below 1 means the kernel is slower).
Writes a JSON file with the environment.

Usage: ``python bench/dispatch_route_overhead.py --out bench/results/cpu/dispatch_route_overhead_session23.json``
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tasks/k3_small_m_gemm/fixtures/good/lean-torch-cpu/k3_model/kernels/small_m_gemm"
SHAPES = [(13, 96, 1), (3, 384, 96), (9, 96, 96), (11, 576, 256)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pairs", type=int, default=4000)
    ap.add_argument("--warmup", type=int, default=300)
    args = ap.parse_args()
    import torch

    import k3_model.kernels as kernels_pkg
    from k3_model import dispatch
    from k3_model.ops import small_m_gemm as op
    from workbench import env as envmod

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp()) / "kernels"
    shutil.copytree(FIXTURE, root / "small_m_gemm")
    kernels_pkg.__path__.insert(0, str(root))
    kernel = dispatch._specialized_module(op.OP, "cpu")
    stand_in = dispatch.StandardRoutedAsKernel(dispatch.declared_scope(op.OP, "cpu"))
    key = dispatch.kernel_key(op.OP, "cpu")

    def side(backend, mod, x, w, out, rows):
        def call() -> int:
            t0 = time.thread_time_ns()
            prev = dispatch._MODULES.get(key)
            dispatch._MODULES[key] = mod
            with dispatch.forward_context(decode_backend=backend, phase="decode", requests=rows, query_len=1):
                op.small_m_gemm(x, w, out=out)
            dispatch._MODULES[key] = prev
            return time.thread_time_ns() - t0
        return call

    rows_out = []
    for M, N, K in SHAPES:
        x, w, out = torch.randn(M, K), torch.randn(N, K), torch.empty(M, N)
        sides = {"standard backend": side("standard", kernel, x, w, out, M),
                 "no kernel merged": side("latency_specialized", None, x, w, out, M),
                 "standard routed as a kernel": side("latency_specialized", stand_in, x, w, out, M),
                 "kernel": side("latency_specialized", kernel, x, w, out, M)}
        for _ in range(args.warmup):
            for f in sides.values():
                f()
        samples = {name: [] for name in sides}
        for _ in range(args.pairs):
            for name, f in sides.items():
                samples[name].append(f())
        row = {"M": M, "N": N, "K": K}
        for name, s in samples.items():
            row[f"{name} median_us"] = round(statistics.median(s) / 1e3, 3)
            if name != "kernel":
                row[f"{name} / kernel ratio"] = round(statistics.median(a / b for a, b in zip(s, samples["kernel"])), 3)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps({"bench": "dispatch_route_overhead", "op": op.OP, "pairs": args.pairs,
                                    "clock": "thread CPU time per call, interleaved", "fixture": str(FIXTURE.relative_to(ROOT)),
                                    "environment": envmod.collect("cpu"), "rows": rows_out}, indent=1) + "\n")
    print(args.out)


if __name__ == "__main__":
    main()
