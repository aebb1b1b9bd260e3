"""The Triton small_m_gemm fixture (a bad fixture for perf: correct, slower than cuBLAS on the H200)
against the task's reference: under Triton's CPU interpreter (``TRITON_INTERPRET=1``, small shapes,
every input case, a strided row view) and, marked ``gpu``, on CUDA over every workload inside its scope
(M <= 16), random shapes and a CUDA-graph replay.

Source: tasks/k3_small_m_gemm/fixtures/bad/perf-fp32-tl-dot-slower-than-cublas (the kernel); tasks/k3_small_m_gemm/reference.py
(oracle and checker); task.toml (workloads, cases, tolerances).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def _tolerances() -> dict[str, dict[str, float]]:
    from workbench.taskspec import load_task

    tol = load_task(ROOT, "k3_small_m_gemm").correctness.tolerance
    return {k: {"rtol": v.rtol, "atol": v.atol} for k, v in tol.items()}


def test_every_input_case_matches_the_reference_under_the_interpreter(tmp_path):
    pytest.importorskip("triton")
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(script), str(KERNEL), str(TASK / "inputs.py"), str(TASK / "reference.py"),
                          json.dumps(INTERPRETED), json.dumps(_tolerances())],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report) == len(INTERPRETED)
    assert any(r["split"][0] > 1 for r in report)  # the split-K reduction ran
    assert [r for r in report if r["msgs"]] == []


def _cuda_modules():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        m = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(m)
        return m

    return load("_gemm_tg", KERNEL), load("_gemm_inp", TASK / "inputs.py"), load("_gemm_ref", TASK / "reference.py")


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
