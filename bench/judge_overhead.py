"""Micro: host cost of one op call through the dispatcher, with and without the child's runtime hooks armed.

Runs the k3_moe_dispatch Triton fixture (CUDA) or the lean CPU fixture in this process, counts the audit
events one call raises, and writes ``OUT`` (JSON, with the environment).

    python bench/judge_overhead.py OUT.json [cuda|cpu]
"""
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(out: str, device: str) -> None:
    import shutil
    import tempfile

    import torch

    fixture = ROOT / "tasks/k3_moe_dispatch/fixtures/good" / ("triton-cuda" if device == "cuda" else "lean-torch-cpu")
    tree = Path(tempfile.mkdtemp(prefix="wb-overhead-"))
    for d in ("k3_model", "kernels", "guards", "workbench", "tasks"):
        shutil.copytree(ROOT / d, tree / d, ignore=shutil.ignore_patterns("fixtures", "__pycache__"))
    shutil.copytree(fixture, tree, dirs_exist_ok=True)  # the candidate's k3_model/kernels/moe_dispatch
    sys.path.insert(0, str(tree))
    fixture = tree
    from guards.cases import build_case
    from k3_model.dispatch import forward_context, record_trace
    from k3_model.ops.moe_dispatch import moe_route_dispatch
    from workbench import env as envmod
    from workbench.taskspec import load_task

    task = load_task(tree, "k3_moe_dispatch")
    case = build_case(task, task.workload("k3_t8"), 1)
    ins = {k: v.to(device) for k, v in case.inputs_a.items()}
    outs = {k: torch.empty(s["shape"], dtype=getattr(torch, s["dtype"]), device=device)
            for k, s in case.output_specs.items()}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call(backend):
        with record_trace() as tr, forward_context(decode_backend=backend, phase="decode"):
            moe_route_dispatch(**ins, **case.kwargs, **outs)
        return tr

    def timed(backend, n=200):
        for _ in range(20):
            call(backend)
        sync()
        xs = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            call(backend)
            sync()
            xs.append((time.perf_counter_ns() - t0) / 1e3)
        xs.sort()
        return xs[len(xs) // 2]

    res = {"device": device, "environment": envmod.collect(device),
           "impl": sorted({d.implementation for d in call("latency_specialized").decisions})}
    for b in ("standard", "latency_specialized"):
        res[f"{b}_median_us_no_hooks"] = timed(b)
    sink = open(out, "w")  # opened before the hooks are armed (they refuse writes outside the scratch folder)
    spec = importlib.util.spec_from_file_location("_h", ROOT / "guards/_child_hooks.py")
    h = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(h)
    hooks = h.arm(worktree=str(fixture), scratch="/tmp", harness=str(ROOT / "guards"))
    hooks.enter_call_phase()
    counts: dict = {}
    sys.addaudithook(lambda e, a: counts.__setitem__(e, counts.get(e, 0) + 1))
    for b in ("standard", "latency_specialized"):
        res[f"{b}_median_us_hooks"] = timed(b)
    res["audit_events_during_timing"] = counts
    res["violations"] = hooks.violations()
    sink.write(json.dumps(res, indent=1))
    sink.close()
    print(json.dumps({k: v for k, v in res.items() if k != "environment"}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu")
