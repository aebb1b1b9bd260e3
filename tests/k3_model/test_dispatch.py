"""The dispatcher: latency-specialized only when switched on, merged, and in the declared scope;
every decision recorded with its reason."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from k3_model import dispatch
from k3_model.dispatch import DispatchError, OpScope, declared_scope, forward_context, record_trace
from k3_model.ops.moe_dispatch import align_capacity, moe_route_dispatch

OPMOD = "k3_model.kernels.moe_dispatch"


@pytest.fixture
def fake_kernel(monkeypatch):
    """Install a fake merged kernel for moe_dispatch that marks its outputs, and clear the cache."""
    calls = []

    def entry(router_logits, e_score_correction_bias, token_valid, **kw):
        calls.append(router_logits.shape[0])
        from k3_model.ops.moe_dispatch import moe_route_dispatch_standard

        moe_route_dispatch_standard(router_logits, e_score_correction_bias, token_valid, **kw)

    mod = types.ModuleType(OPMOD)
    mod.__file__ = "<fake>"
    mod.SCOPE = OpScope(devices=("cpu",), batch_min=1, batch_max=16)
    mod.moe_route_dispatch = entry
    monkeypatch.setitem(sys.modules, OPMOD, mod)
    monkeypatch.setattr(dispatch, "_MODULES", {})
    yield calls
    dispatch._MODULES.clear()


def _call(T: int, E: int = 32, K: int = 4):
    cap, nb = align_capacity(T, K, E, 16)
    outs = dict(topk_weights=torch.empty(T, K), topk_ids=torch.empty(T, K, dtype=torch.int32),
                sorted_token_ids=torch.empty(cap, dtype=torch.int32), expert_ids=torch.empty(nb, dtype=torch.int32),
                num_tokens_post_padded=torch.empty(1, dtype=torch.int32))
    moe_route_dispatch(torch.randn(T, E), torch.zeros(E), torch.ones(T, dtype=torch.bool), top_k=K, n_group=1,
                       topk_group=1, renormalize=True, routed_scaling_factor=1.0, block_size=16, **outs)
    return outs


def test_in_scope_decode_runs_latency_specialized(fake_kernel):
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        _call(8)
    assert tr.implementations() == ["latency_specialized"]
    assert fake_kernel == [8]
    assert "in scope" in tr.decisions[0].reason


@pytest.mark.parametrize(
    "backend, phase, T, reason",
    [("standard", "decode", 8, "decode_backend is standard"),
     ("latency_specialized", "prefill", 8, "phase 'prefill' not in ['decode']"),
     ("latency_specialized", "mixed", 8, "phase 'mixed'"),
     ("latency_specialized", "decode", 17, "batch 17 outside [1, 16]")],
)
def test_out_of_scope_falls_back_with_reason(fake_kernel, backend, phase, T, reason):
    with record_trace() as tr, forward_context(decode_backend=backend, phase=phase):
        _call(T)
    assert tr.implementations() == ["standard"]
    assert reason in tr.decisions[0].reason
    assert fake_kernel == []


def test_no_forward_context_is_standard_and_says_so(fake_kernel):
    with record_trace() as tr:
        _call(4)
    assert tr.decisions[0].implementation == "standard"
    assert tr.decisions[0].reason == "no forward context: batch phase unknown"


def test_nothing_merged_on_base_is_reported():
    dispatch._MODULES.clear()
    assert declared_scope("moe_dispatch") is None  # the base has only a README in the kernel folder
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        _call(2)
    assert tr.decisions[0].reason == "no latency-specialized kernel merged for moe_dispatch"


def test_malformed_kernel_raises_instead_of_silent_fallback(monkeypatch):
    mod = types.ModuleType(OPMOD)
    mod.__file__ = "<fake>"
    mod.SCOPE = {"devices": ["cpu"]}  # not an OpScope
    monkeypatch.setitem(sys.modules, OPMOD, mod)
    monkeypatch.setattr(dispatch, "_MODULES", {})
    with forward_context(decode_backend="latency_specialized", phase="decode"):
        with pytest.raises(DispatchError, match="SCOPE must be a k3_model.dispatch.OpScope"):
            _call(2)


def test_missing_entry_point_raises(monkeypatch):
    mod = types.ModuleType(OPMOD)
    mod.__file__ = "<fake>"
    mod.SCOPE = OpScope(devices=("cpu",))
    monkeypatch.setitem(sys.modules, OPMOD, mod)
    monkeypatch.setattr(dispatch, "_MODULES", {})
    with forward_context(decode_backend="latency_specialized", phase="decode"):
        with pytest.raises(DispatchError, match="entry point 'moe_route_dispatch' is missing"):
            _call(2)


def test_bad_backend_name_is_a_clear_error():
    with pytest.raises(ValueError, match="decode_backend 'fast' is not one of"):
        with forward_context(decode_backend="fast", phase="decode"):
            pass


def test_standard_op_rejects_wrong_output_buffer():
    T, E, K = 2, 8, 2
    with pytest.raises(ValueError, match="output sorted_token_ids must be"):
        moe_route_dispatch(torch.randn(T, E), torch.zeros(E), torch.ones(T, dtype=torch.bool), top_k=K, n_group=1,
                           topk_group=1, renormalize=True, routed_scaling_factor=1.0, block_size=16,
                           topk_weights=torch.empty(T, K), topk_ids=torch.empty(T, K, dtype=torch.int32),
                           sorted_token_ids=torch.empty(3, dtype=torch.int32), expert_ids=torch.empty(2, dtype=torch.int32),
                           num_tokens_post_padded=torch.empty(1, dtype=torch.int32))


def test_group_limited_topk_negative_scores_stays_in_kept_group():
    # kernel_targets.md §3.4 / vLLM PR #13474: masked groups must be -inf, not 0
    cap, nb = align_capacity(1, 2, 8, 16)
    outs = dict(topk_weights=torch.empty(1, 2), topk_ids=torch.empty(1, 2, dtype=torch.int32),
                sorted_token_ids=torch.empty(cap, dtype=torch.int32), expert_ids=torch.empty(nb, dtype=torch.int32),
                num_tokens_post_padded=torch.empty(1, dtype=torch.int32))
    logits = torch.tensor([[2.0, 1, 0, 0, -1, -1, -2, -2]])
    moe_route_dispatch(logits, torch.full((8,), -1.0), torch.ones(1, dtype=torch.bool), top_k=2, n_group=4,
                       topk_group=1, renormalize=True, routed_scaling_factor=1.0, block_size=16, **outs)
    assert sorted(outs["topk_ids"][0].tolist()) == [0, 1]
    s = torch.sigmoid(torch.tensor([2.0, 1.0]))
    got = dict(zip(outs["topk_ids"][0].tolist(), outs["topk_weights"][0].tolist()))
    assert got[0] == pytest.approx(float(s[0] / s.sum()), rel=1e-6)
    assert got[1] == pytest.approx(float(s[1] / s.sum()), rel=1e-6)
