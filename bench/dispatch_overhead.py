"""The dispatcher's own cost per op call on CPU: ``k3_model.dispatch.select`` for the merged moe_dispatch kernel,
with the route memo (``_ROUTES``) and with it emptied before every call, against the standard backend.

Times ``select`` alone (the op's argument checks and the kernel itself are the same in every mode) on a
decode call of K3's router shape (T 8, E 384; the shape axes the op reports), in this thread's CPU time
(``time.thread_time_ns``), best of ``--rounds`` rounds of ``--calls`` calls, and writes a JSON file with the
environment.

Usage: ``python bench/dispatch_overhead.py --out bench/results/cpu/dispatch_overhead_session18.json``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import torch

    from k3_model import dispatch
    from k3_model.ops import moe_dispatch
    from workbench import env as envmod

    logits = torch.randn(8, 384)
    shapes = moe_dispatch.shape_axes(logits, 8, 1, 1, 16)
    dispatch.declared_scope(moe_dispatch.OP, "cpu")  # the kernel module is imported once, before timing

    def call() -> object:
        return dispatch.select(moe_dispatch.OP, "moe_route_dispatch", moe_dispatch.moe_route_dispatch_standard,
                               rows=8, device="cpu", dtype="float32", shapes=shapes)

    modes = {
        "standard backend": ("standard", False),
        "latency_specialized, route memo": ("latency_specialized", False),
        "latency_specialized, memo emptied every call": ("latency_specialized", True),
    }
    rows = []
    for name, (backend, empty) in modes.items():
        best = None
        with dispatch.forward_context(decode_backend=backend, phase="decode"), dispatch.record_trace() as trace:
            for _ in range(args.rounds):
                trace.decisions.clear()
                t0 = time.thread_time_ns()
                for _ in range(args.calls):
                    if empty:
                        dispatch._ROUTES.clear()
                    call()
                per_call = (time.thread_time_ns() - t0) / args.calls / 1e3
                best = per_call if best is None else min(best, per_call)
            impl = trace.decisions[-1].implementation
        rows.append({"mode": name, "implementation": impl, "us_per_call": round(best, 2)})
        print(json.dumps(rows[-1]), flush=True)
    args.out.write_text(json.dumps({"bench": "dispatch_overhead", "op": moe_dispatch.OP, "calls": args.calls,
                                    "rounds": args.rounds, "clock": "thread CPU time, best round",
                                    "environment": envmod.collect("cpu"), "rows": rows}, indent=1) + "\n")
    print(args.out)


if __name__ == "__main__":
    main()
