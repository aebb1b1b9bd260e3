"""The Triton small_m_gemm fixture (a bad fixture for perf: correct, slower than cuBLAS on the H200)
against the task's reference: under Triton's CPU interpreter (``TRITON_INTERPRET=1``, small shapes,
every input case, a strided row view) and, marked ``gpu``, on CUDA over every workload inside its scope
(M <= 16), random shapes and a CUDA-graph replay.

Source: tasks/k3_small_m_gemm/fixtures/bad/perf-fp32-tl-dot-slower-than-cublas (the kernel); tasks/k3_small_m_gemm/reference.py
(oracle and checker); task.toml (workloads, cases, tolerances).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tasks.triton_harness import cuda_modules, run_interpreted

ROOT = Path(__file__).resolve().parents[2]
TASK = ROOT / "tasks" / "k3_small_m_gemm"
KERNEL = TASK / "fixtures" / "bad" / "perf-fp32-tl-dot-slower-than-cublas" / "k3_model" / "kernels" / "small_m_gemm" / "_triton_gemm.py"

# (case, M, N, K): every input case, K not a multiple of BLOCK_K, N not a multiple of BLOCK_N, M = 1 and 16
INTERPRETED = [("realistic", 1, 33, 300), ("realistic", 16, 64, 256), ("padding_rows", 8, 40, 130),
               ("outlier_channels", 4, 70, 1037), ("row_scales", 5, 31, 257), ("realistic", 3, 4, 129)]

_SCRIPT = r"""
import importlib.util, json, sys, torch, triton
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path); m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m); return m
tg, inp, ref = load("tg", sys.argv[1]), load("inp", sys.argv[2]), load("ref", sys.argv[3])
tol = {k: type("Tol", (), v) for k, v in json.loads(sys.argv[5]).items()}  # rtol, atol attributes
tg._SMS[0] = 4  # the interpreter has no SMs: 4 gives several K splits on these small shapes
tg.torch.cuda.current_device = lambda: 0
tg.torch.cuda.current_stream = lambda device=None: type("S", (), {"cuda_stream": 0})()
report = []
for case, M, N, K in json.loads(sys.argv[4]):
    x = inp.make_inputs({"M": M, "N": N, "K": K}, 1, case)
    wide = torch.full((M, K + 5), float("nan"))
    wide[:, :K] = x["x"]
    xv = wide[:, :K]  # a row view: row stride K + 5
    out = torch.full((M, N), float("nan"))
    tg.launch(xv, x["weight"], out)
    want = ref.reference(x, {})
    report.append({"case": case, "M": M, "split": tg._splits(N, K, torch.device("cpu")),
                   "msgs": ref.check(x, {}, {"out": out}, want, tol)})
print(json.dumps(report))
"""


def test_every_input_case_matches_the_reference_under_the_interpreter(tmp_path):
    report = run_interpreted(tmp_path, _SCRIPT, KERNEL, "k3_small_m_gemm", INTERPRETED)
    assert any(r["split"][0] > 1 for r in report)  # the split-K reduction ran
    assert [r for r in report if r["msgs"]] == []


def _cuda_modules():
    return cuda_modules("_gemm", KERNEL, "k3_small_m_gemm")


@pytest.mark.gpu
def test_every_workload_in_scope_and_random_shapes_match_the_reference_on_cuda():
    from workbench.taskspec import load_task

    tg, inp, ref = _cuda_modules()
    task = load_task(ROOT, "k3_small_m_gemm")
    tol = task.correctness.tolerance
    shapes = [(dict(w.axes), w.case or "realistic") for w in task.correctness.workloads if w.axes["M"] <= tg.MAX_M]
    g = torch.Generator().manual_seed(5)
    for _ in range(10):
        shapes.append(({"M": int(torch.randint(1, 17, (1,), generator=g)), "N": int(torch.randint(1, 12449, (1,), generator=g)),
                        "K": int(torch.randint(1, 7169, (1,), generator=g))},
                       list(inp.CASES)[int(torch.randint(0, len(inp.CASES), (1,), generator=g))]))
    bad = []
    for axes, case in shapes:
        x = inp.make_inputs(axes, 7, case)
        out = torch.full((axes["M"], axes["N"]), float("nan"), device="cuda")
        tg.launch(x["x"].cuda(), x["weight"].cuda(), out)
        msgs = ref.check(x, {}, {"out": out.cpu()}, ref.reference(x, {}), tol)
        bad += [f"{case} {axes}: {m}" for m in msgs]
    assert bad == []


@pytest.mark.gpu
def test_graph_replay_recomputes_on_new_inputs():
    from workbench.taskspec import load_task

    tg, inp, ref = _cuda_modules()
    axes = {"M": 8, "N": 2112, "K": 7168}
    a, b = inp.make_inputs(axes, 1, "realistic"), inp.make_inputs(axes, 2, "padding_rows")
    x, w = a["x"].cuda(), a["weight"].cuda()
    out = torch.empty(8, 2112, device="cuda")
    tg.launch(x, w, out)  # compile and size the workspace outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tg.launch(x, w, out)
    x.copy_(b["x"])
    w.copy_(b["weight"])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    tol = load_task(ROOT, "k3_small_m_gemm").correctness.tolerance
    assert ref.check(b, {}, {"out": out.cpu()}, ref.reference(b, {}), tol) == []
