"""The CuTe DSL moe_dispatch fixture against the task's checker, on CUDA (``gpu``; skipped without CUDA,
CuTe DSL or apache-tvm-ffi): every fixed workload and some random domain draws, each called twice,
outputs poisoned first; and a CUDA-graph replay on new inputs (a launch that escaped capture would
leave the poison).

Source: tasks/k3_moe_dispatch/fixtures/good/cutedsl-cuda (the kernel); bench/cutedsl_moe_check.py
(the checks, shared with the device run); tasks/k3_moe_dispatch/reference.py (oracle and checker).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NEEDS = [m for m in ("cutlass", "tvm_ffi") if importlib.util.find_spec(m) is None]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(bool(NEEDS), reason=f"needs {NEEDS} (pip install nvidia-cutlass-dsl apache-tvm-ffi)"),
]


def _check_module():
    spec = importlib.util.spec_from_file_location("cutedsl_moe_check", ROOT / "bench" / "cutedsl_moe_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _modules(chk):
    inp = chk._load("moe_inputs", chk.TASK / "inputs.py")
    ref = chk._load("moe_reference", chk.TASK / "reference.py")
    cute = chk._load("moe_cute", chk.FIX / "cutedsl-cuda" / "k3_model" / "kernels" / "moe_dispatch" / "_cute_route.py")
    return inp, ref, cute


def test_every_workload_and_random_draws_pass_the_checker():
    from workbench.taskspec import load_task

    chk = _check_module()
    inp, ref, cute = _modules(chk)
    rows = chk.correctness(cute, inp, ref, load_task(ROOT, "k3_moe_dispatch"), seeds=1, draws=8)
    bad = [(r["name"], r["axes"], r["case"], r["msgs"][:2]) for r in rows if r["msgs"]]
    assert bad == []


def test_graph_replay_recomputes_on_new_inputs():
    from workbench.taskspec import load_task

    chk = _check_module()
    inp, ref, cute = _modules(chk)
    got = chk.capture(cute, inp, ref, load_task(ROOT, "k3_moe_dispatch"))
    assert got == {"replay_msgs": [], "unwritten": 0}
