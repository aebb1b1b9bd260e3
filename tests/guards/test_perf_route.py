"""The perf guard's timed baseline pays the candidate's dispatch route (``guards/_child_main.py`` ``_serve`` and
``_route_standard_as``, ``k3_model.dispatch.StandardRoutedAsKernel``): with no kernel at the base, the baseline
child's calls reach the standard path through the same scope check as the candidate's calls, so the
dispatcher's own per-call cost (``bench/results/cpu/dispatch_route_overhead_session23.json``) is not charged to
the candidate. The landing CI of session 22's work rejected a kernel that runs the standard computation on
tiny GEMMs at 0.876x for that cost alone."""

from __future__ import annotations

import importlib.util
import sys
import types

import torch

from k3_model import dispatch
from k3_model.dispatch import OpScope
from tests.conftest import REPO_ROOT

OPMOD = "k3_model.kernels.small_m_gemm"


def _child_main():
    spec = importlib.util.spec_from_file_location("_wb_test_child_main_route", REPO_ROOT / "guards" / "_child_main.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _case(M=4, N=8, K=16):
    x, w = torch.randn(M, K), torch.randn(N, K)
    return {"name": "tiny", "phase": "decode", "requests": M, "query_len": 1, "inputs_a": {"x": x, "weight": w},
            "kwargs": {}, "outputs": {"out": {"shape": [M, N], "dtype": "float32", "poison": 0.0, "poison_random": False}}}


def _run(monkeypatch, scope, base_mod=None):
    """``_perf_case`` in this process on a tiny small_m_gemm call; returns its result and, per call, the
    forward context's backend and the type of the module the dispatcher held for the op."""
    from k3_model.ops.small_m_gemm import small_m_gemm, small_m_gemm_standard

    kernel_calls = []
    mod = types.ModuleType(OPMOD)
    mod.__file__ = "<candidate>"
    mod.SCOPE = scope

    def kernel(x, weight, *, out):
        kernel_calls.append(x.shape[0])
        small_m_gemm_standard(x, weight, out=out)

    mod.small_m_gemm = kernel
    monkeypatch.setitem(sys.modules, OPMOD, mod)
    monkeypatch.setattr(dispatch, "_MODULES", {})
    monkeypatch.setattr(dispatch, "_KEYS", {})
    seen = []

    def op(x, weight, out):
        seen.append((dispatch._CTX.get().decode_backend, type(dispatch._MODULES.get("small_m_gemm")).__name__))
        small_m_gemm(x, weight, out=out)

    dispatch.declared_scope("small_m_gemm", "cpu")  # the child's main imports the candidate's kernel first
    child = _child_main()
    child._bind_torch()
    req = {"device": "cpu", "decode_backend": "latency_specialized", "op": "small_m_gemm",
           "perf": {"warmup": 2, "repetitions": 6}, "_baseline_module": base_mod}
    res = child._perf_case(op, dispatch.forward_context, dispatch.record_trace, req, _case())
    return res, seen, kernel_calls


def test_shared_process_baseline_keeps_the_standard_backend(monkeypatch):
    """The single-child path (``_perf_case``: TP collectives) times both sides in one process. There the
    baseline keeps ``decode_backend=standard`` and never routes through the dispatcher's caches, which the
    candidate's code shares and could empty to slow a routed baseline (session 23's review); only the call
    servers' separate baseline child routes as the candidate (``_route_standard_as``, below)."""
    res, seen, kernel_calls = _run(monkeypatch, OpScope(devices=("cpu",), requests_max=16))
    probe_base, probe_cand, timed = seen[0], seen[1], seen[2:]
    assert probe_base == ("standard", "module") and probe_cand == ("latency_specialized", "module")  # untimed probes
    base_timed = [s for s in timed if s[0] == "standard"]
    cand_timed = [s for s in timed if s == ("latency_specialized", "module")]
    assert len(base_timed) == len(cand_timed) == res["calls"]["baseline"] == res["calls"]["candidate"] >= 8
    assert len(base_timed) + len(cand_timed) == len(timed)
    assert not any(t == "StandardRoutedAsKernel" for _b, t in seen)
    assert len(kernel_calls) == 1 + res["calls"]["candidate"]  # the baseline's timed calls never ran the kernel
    assert [d["reason"] for d in res["trace_baseline"]] == ["decode_backend is standard"]
    assert [d["implementation"] for d in res["trace_candidate"]] == ["latency_specialized"]
    assert len(res["baseline_us"]) == len(res["candidate_us"]) == 6


def test_a_kernel_merged_at_the_base_is_timed_as_itself(monkeypatch):
    """With the base commit's kernel loaded, the timed baseline calls hold that module, not the stand-in."""
    base = types.ModuleType("base_kernel")
    base.__file__ = "<base>"
    base.SCOPE = OpScope(devices=("cpu",), requests_max=16)
    base.small_m_gemm = lambda x, weight, *, out: torch.mm(x, weight.t(), out=out)
    _res, seen, _calls = _run(monkeypatch, OpScope(devices=("cpu",), requests_max=16), base_mod=base)
    assert set(seen) == {("latency_specialized", "module")}  # probes and timed calls: base or candidate module


# ---- the perf guard's call servers (guards/judge.py): the baseline child routes as the candidate's scope

def test_baseline_request_carries_the_declared_scope():
    from guards.perf import baseline_request

    req = {"target": "t:f", "op": "small_m_gemm", "device": "cpu", "decode_backend": "latency_specialized"}
    scope = {"devices": ["cpu"], "phases": ["decode"], "requests_min": 2, "requests_max": 16}
    assert baseline_request(req, scope) == {**req, "measure_floor": False, "route_as": scope}
    assert baseline_request({**req, "device": "cuda"}, {})["route_as"] is None
    assert baseline_request({**req, "device": "cuda"}, {})["measure_floor"] is True


def test_baseline_child_installs_the_stand_in_only_without_a_base_kernel(monkeypatch):
    from k3_model.ops.small_m_gemm import small_m_gemm

    child = _child_main()
    monkeypatch.setattr(dispatch, "_MODULES", {})
    monkeypatch.setattr(dispatch, "_KEYS", {})
    monkeypatch.setitem(sys.modules, OPMOD, types.ModuleType(OPMOD))  # nothing merged at the base
    declared = {"devices": ["cpu"], "phases": ["decode"], "tp_sizes": [1], "dtypes": ["float32"], "requests_min": 2,
                "requests_max": 16, "shapes": {"K": {"choices": [96, 7168]}}}
    assert child._route_standard_as("small_m_gemm", "cpu", declared) is True
    stand_in = dispatch._MODULES["small_m_gemm"]
    assert type(stand_in) is dispatch.StandardRoutedAsKernel
    assert stand_in.SCOPE.requests_max == 16 and stand_in.SCOPE.shapes == {"K": {"choices": (96, 7168)}}
    x, w, out = torch.randn(4, 96), torch.randn(8, 96), torch.empty(4, 8)
    with dispatch.record_trace() as tr, dispatch.forward_context(decode_backend="latency_specialized", phase="decode"):
        small_m_gemm(x, w, out=out)
    assert tr.implementations() == ["standard"] and tr.decisions[0].reason.startswith("the standard path routed as a kernel")
    assert torch.equal(out, x @ w.t())
    # a kernel merged at the base is timed as itself
    base = types.ModuleType(OPMOD)
    base.__file__ = "<base>"
    base.SCOPE = OpScope(devices=("cpu",), requests_max=4)
    base.small_m_gemm = lambda x, weight, *, out: torch.mm(x, weight.t(), out=out)
    monkeypatch.setitem(sys.modules, OPMOD, base)
    monkeypatch.setattr(dispatch, "_MODULES", {})
    assert child._route_standard_as("small_m_gemm", "cpu", declared) is False
    assert dispatch._MODULES["small_m_gemm"] is base
