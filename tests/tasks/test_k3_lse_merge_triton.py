"""The Triton lse_merge fixture against the task's reference: under Triton's CPU interpreter
(``TRITON_INTERPRET=1``, small shapes, every input case) and, marked ``gpu``, on CUDA over every
workload of task.toml, random draws and a CUDA-graph replay.

Source: tasks/k3_lse_merge/fixtures/good/triton-cuda (the kernel); tasks/k3_lse_merge/reference.py
(oracle and checker); task.toml (workloads, cases, tolerances).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tasks.triton_harness import cuda_modules, run_interpreted

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "tasks" / "k3_lse_merge"
KERNEL = TASK / "fixtures" / "good" / "triton-cuda" / "k3_model" / "kernels" / "lse_merge" / "_triton_merge.py"

# (case, N, B, H, D, base_e): every input case of inputs.py, odd sizes (a partial D tile), both bases
INTERPRETED = [("realistic", 3, 2, 3, 33, True), ("empty_chunks", 4, 3, 2, 16, True), ("all_empty", 2, 2, 2, 8, False),
               ("plus_inf_lse", 4, 2, 2, 8, True), ("nan_lse", 4, 2, 2, 8, True), ("mixed_markers", 8, 2, 2, 8, False),
               ("large_lse", 8, 2, 2, 8, True), ("large_lse", 4, 2, 2, 8, False), ("dominant_chunk", 8, 2, 2, 8, True),
               ("realistic", 1, 2, 2, 300, True)]

_SCRIPT = r"""
import importlib.util, json, sys, torch
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m); return m
tm, inp, ref = load("tm", sys.argv[1]), load("inp", sys.argv[2]), load("ref", sys.argv[3])
tol = {k: type("Tol", (), v) for k, v in json.loads(sys.argv[5]).items()}  # rtol, atol attributes
tm.MAX_BLOCK_D = 128  # D = 300 spans three tiles, the last partial
report = []
for case, N, B, H, D, base_e in json.loads(sys.argv[4]):
    x = inp.make_inputs({"N": N, "B": B, "H": H, "D": D}, 1, case)
    out, out_lse = torch.full((B, H, D), 7.0), torch.full((B, H), 7.0)
    tm.launch(x["outs"], x["lses"], base_e=base_e, out=out, out_lse=out_lse)
    want = ref.reference(x, {"base_e": base_e})
    report.append({"case": case, "N": N, "msgs": ref.check(x, {"base_e": base_e}, {"out": out, "out_lse": out_lse}, want, tol)})
print(json.dumps(report))
"""


def test_every_input_case_matches_the_reference_under_the_interpreter(tmp_path):
    report = run_interpreted(tmp_path, _SCRIPT, KERNEL, "k3_lse_merge", INTERPRETED)
    assert [r for r in report if r["msgs"]] == []


def _cuda_modules():
    return cuda_modules("_lse", KERNEL, "k3_lse_merge")


@pytest.mark.gpu
def test_every_workload_and_random_draws_match_the_reference_on_cuda():
    from workbench.taskspec import load_task

    tm, inp, ref = _cuda_modules()
    task = load_task(ROOT, "k3_lse_merge")
    tol = task.correctness.tolerance
    shapes = [(w.axes, w.params.get("base_e", True), w.case or "realistic") for w in task.correctness.workloads]
    g = torch.Generator().manual_seed(3)
    for _ in range(8):  # random shapes across the domain, every case
        ax = {"N": int(torch.randint(1, 17, (1,), generator=g)), "B": int(torch.randint(1, 65, (1,), generator=g)),
              "H": int(torch.randint(1, 129, (1,), generator=g)), "D": int(torch.randint(1, 1025, (1,), generator=g))}
        case = list(inp.CASES)[int(torch.randint(0, len(inp.CASES), (1,), generator=g))]
        shapes.append((ax, bool(torch.randint(0, 2, (1,), generator=g)), case))
    bad = []
    for axes, base_e, case in shapes:
        x = inp.make_inputs(axes, 7, case)
        B, H, D = axes["B"], axes["H"], axes["D"]
        out = torch.full((B, H, D), 7.0, device="cuda")
        out_lse = torch.full((B, H), 7.0, device="cuda")
        tm.launch(x["outs"].cuda(), x["lses"].cuda(), base_e=base_e, out=out, out_lse=out_lse)
        want = ref.reference(x, {"base_e": base_e})
        msgs = ref.check(x, {"base_e": base_e}, {"out": out.cpu(), "out_lse": out_lse.cpu()}, want, tol)
        bad += [f"{case} {axes}: {m}" for m in msgs]
    assert bad == []


@pytest.mark.gpu
def test_graph_replay_recomputes_on_new_inputs():
    tm, inp, ref = _cuda_modules()
    axes = {"N": 8, "B": 16, "H": 96, "D": 512}
    a, b = inp.make_inputs(axes, 1, "realistic"), inp.make_inputs(axes, 2, "empty_chunks")
    outs, lses = a["outs"].cuda(), a["lses"].cuda()
    out, out_lse = torch.empty(16, 96, 512, device="cuda"), torch.empty(16, 96, device="cuda")
    tm.launch(outs, lses, base_e=True, out=out, out_lse=out_lse)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tm.launch(outs, lses, base_e=True, out=out, out_lse=out_lse)
    outs.copy_(b["outs"])
    lses.copy_(b["lses"])
    out.fill_(7.0)
    graph.replay()
    torch.cuda.synchronize()
    want = ref.reference(b, {"base_e": True})
    from workbench.taskspec import load_task

    tol = load_task(ROOT, "k3_lse_merge").correctness.tolerance
    assert ref.check(b, {"base_e": True}, {"out": out.cpu(), "out_lse": out_lse.cpu()}, want, tol) == []
