"""The CuTe DSL dspark_verify fixture.

CPU (always): the wrapper's own argument checks (bfloat16 logits, batch 1-64, D 1-8, shapes) raise a
``ValueError`` naming the limit before any CuTe DSL import, and the package imports without cutlass.
GPU (``gpu``; skipped without CUDA, CuTe DSL or apache-tvm-ffi): every fixed workload and some random
domain draws against the task's checker, each called twice with poisoned outputs, plus the batch
permutation relation; and a CUDA-graph replay on new inputs (a launch that escaped capture would leave
the poison).

Source: tasks/k3_dspark_verify/fixtures/good/cutedsl-cuda (the kernel); bench/cutedsl_dspark_check.py
(the checks, shared with the device run); tasks/k3_dspark_verify/reference.py (oracle and checker).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "tasks" / "k3_dspark_verify" / "fixtures" / "good" / "cutedsl-cuda" / "k3_model" / "kernels" / "dspark_verify"
NEEDS = [m for m in ("cutlass", "tvm_ffi") if importlib.util.find_spec(m) is None]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _init():
    return _load("dspark_cute_init_test", PKG / "__init__.py")


def _args(B=2, D=3, V=16, dtype=torch.bfloat16, q=False):
    return (torch.zeros(B, D + 1, V, dtype=dtype), torch.zeros(B, D, dtype=torch.int32),
            torch.zeros(B, D, V) if q else None, D)


def test_package_imports_without_cutedsl_and_declares_cuda_only():
    init = _init()
    assert init.SCOPE.devices == ("cuda",) and init.SCOPE.requests_max == init.MAX_B == 64


def test_declared_cuda_only_so_cpu_runs_skip_it():
    from workbench.fixtures import list_fixtures
    from workbench.taskspec import load_task

    fxs = {f.name: f for f in list_fixtures(load_task(ROOT, "k3_dspark_verify"))}
    assert fxs["cutedsl-cuda"].good and fxs["cutedsl-cuda"].devices == ("cuda",)
    assert not fxs["cutedsl-cuda"].runs_on("cpu") and fxs["cutedsl-cuda"].runs_on("cuda")


def test_accepts_the_declared_shapes():
    init = _init()
    init.check_args(*_args())
    init.check_args(*_args(B=64, D=8, V=3, q=True))


@pytest.mark.parametrize("kw, match", [
    ({"dtype": torch.float32}, "bfloat16"),
    ({"B": 65}, r"batch 65 outside \[1, 64\]"),
    ({"D": 9}, r"max_draft_tokens 9 must lie in \[1, 8\]"),
    ({"V": 1}, "vocabulary 1 < 2"),
])
def test_rejects_what_its_workspace_cannot_hold(kw, match):
    with pytest.raises(ValueError, match=match):
        _init().check_args(*_args(**kw))


def test_rejects_mismatched_shapes():
    init = _init()
    logits, drafts, _, D = _args()
    with pytest.raises(ValueError, match="D\\+1 positions"):
        init.check_args(logits, drafts, None, D + 1)
    with pytest.raises(ValueError, match="draft_token_ids must be"):
        init.check_args(logits, drafts[:, :2], None, D)
    with pytest.raises(ValueError, match="draft_probs must be"):
        init.check_args(logits, drafts, torch.zeros(2, D, 15), D)
    with pytest.raises(ValueError, match=r"\(B, D\+1, V\)"):
        init.check_args(logits[0], drafts, None, D)


def _check_module():
    return _load("cutedsl_dspark_check", ROOT / "bench" / "cutedsl_dspark_check.py")


def _launch(chk):
    init = _init()
    cute = chk._load("dspark_cute", PKG / "_cute_verify.py")

    def launch(tl, dr, n, dp, t, k, p, u, e, **kw):
        init.check_args(tl, dr, dp, kw["max_draft_tokens"])
        cute.launch(tl, dr, n, dp, t, k, p, u, e, **kw)

    return launch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(bool(NEEDS), reason=f"needs {NEEDS} (pip install nvidia-cutlass-dsl apache-tvm-ffi)")
def test_every_workload_and_random_draws_pass_the_checker():
    from workbench.taskspec import load_task

    chk = _check_module()
    inp = chk._load("dspark_inputs", chk.TASK / "inputs.py")
    ref = chk._load("dspark_reference", chk.TASK / "reference.py")
    rows = chk.correctness(_launch(chk), inp, ref, load_task(ROOT, "k3_dspark_verify"), seeds=1, draws=8)
    bad = [(r["name"], r["axes"], r["case"], r["msgs"][:2]) for r in rows if r["msgs"]]
    assert bad == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(bool(NEEDS), reason=f"needs {NEEDS} (pip install nvidia-cutlass-dsl apache-tvm-ffi)")
def test_graph_replay_recomputes_on_new_inputs():
    from workbench.taskspec import load_task

    chk = _check_module()
    inp = chk._load("dspark_inputs", chk.TASK / "inputs.py")
    ref = chk._load("dspark_reference", chk.TASK / "reference.py")
    got = chk.capture(_launch(chk), inp, ref, load_task(ROOT, "k3_dspark_verify"))
    assert got == {"replay_msgs": [], "unwritten": 0}
