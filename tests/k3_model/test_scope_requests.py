"""Scopes in requests and query tokens per request (issue 21 stage 1; docs/scope-requests.md): a decode step
has query length 1, a verification step of D draft tokens 1 + D; the dispatcher, the task spec and the vLLM
plugin's step classification use the same fields, and the old row bounds are refused with their replacements."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from k3_model import dispatch
from k3_model.dispatch import OpScope, ScopeError, forward_context, parse_scope, record_trace
from k3_model.vllm_plugin.batch import classify_batch
from tests.k3_model.test_dispatch import _call as _route  # one MoE routing call of T rows
from workbench.errors import TaskSpecError
from workbench.taskspec import load_task, load_task_file

OPMOD = "k3_model.kernels.moe_dispatch"
ROOT = Path(__file__).resolve().parents[2]


def _install(monkeypatch, scope) -> list[int]:
    calls: list[int] = []

    def entry(router_logits, e_score_correction_bias, token_valid, **kw):
        from k3_model.ops.moe_dispatch import moe_route_dispatch_standard

        calls.append(router_logits.shape[0])
        moe_route_dispatch_standard(router_logits, e_score_correction_bias, token_valid, **kw)

    mod = types.ModuleType(OPMOD)
    mod.__file__ = "<fake>"
    mod.SCOPE = scope
    mod.moe_route_dispatch = entry
    monkeypatch.setitem(sys.modules, OPMOD, mod)
    monkeypatch.setattr(dispatch, "_MODULES", {})
    monkeypatch.setattr(dispatch, "_ROUTES", {})
    return calls


@pytest.mark.parametrize("key", ["batch_min", "batch_max"])
def test_old_row_bounds_are_a_scope_error_naming_their_replacements(key):
    with pytest.raises(ScopeError) as info:
        parse_scope({"devices": ("cpu",), key: 8}, where="K")
    msg = str(info.value)
    assert msg.startswith(f"K: SCOPE names {key}: batch_min/batch_max counted token rows"), msg
    assert "requests_min/requests_max" in msg and "query_len_min/query_len_max" in msg and '"spec_verify"' in msg


def test_old_row_bounds_as_opscope_keywords_are_refused_by_python():
    with pytest.raises(TypeError, match="batch_max"):
        OpScope(devices=("cpu",), batch_max=64)  # type: ignore[call-arg]


@pytest.mark.parametrize("kwargs, msg", [
    ({"query_len_max": 8}, 'query_len_max 8 needs "spec_verify" in phases'),
    ({"phases": ("spec_verify",)}, 'lists "spec_verify" but query_len_max is 1'),
    ({"phases": ("verify",)}, "OpScope phases ['verify'] are not step phases"),
    ({"query_len_min": 3, "query_len_max": 2, "phases": ("spec_verify",)}, "query length range [3, 2] is empty"),
    ({"query_len_min": 0}, "query length range [0, 1] is empty or below 1"),
])
def test_query_length_and_phases_must_agree(kwargs, msg):
    with pytest.raises(ScopeError) as info:
        OpScope(devices=("cpu",), **kwargs)
    assert msg in str(info.value), str(info.value)


def test_decode_only_scope_runs_decode_and_falls_back_on_verification_steps(monkeypatch):
    calls = _install(monkeypatch, OpScope(devices=("cpu",), requests_min=1, requests_max=64))
    with record_trace() as tr:
        with forward_context(decode_backend="latency_specialized", phase="decode", requests=8):
            _route(8)
        with forward_context(decode_backend="latency_specialized", phase="spec_verify", requests=1, query_len=8):
            _route(8)  # batch 1 with 7 drafts: the same 8 rows, another step
    assert calls == [8]
    d0, d1 = tr.decisions
    assert (d0.implementation, d0.requests, d0.query_len, d0.rows) == ("latency_specialized", 8, 1, 8)
    assert (d1.implementation, d1.phase, d1.requests, d1.query_len, d1.rows) == ("standard", "spec_verify", 1, 8, 8)
    assert d1.reason == "out of declared scope: phase 'spec_verify' not in ['decode']"


def test_verification_scope_counts_requests_not_rows(monkeypatch):
    """The seed's scope, decode batch 1-64 with 7 draft tokens: 16 verifying requests are 128 rows and in
    scope; a 9th draft token (query length 9) is not."""
    scope = OpScope(devices=("cpu",), phases=("decode", "spec_verify"), requests_min=1, requests_max=64,
                    query_len_min=1, query_len_max=8)
    calls = _install(monkeypatch, scope)
    with record_trace() as tr:
        with forward_context(decode_backend="latency_specialized", phase="spec_verify", requests=16, query_len=8):
            _route(128)
        with forward_context(decode_backend="latency_specialized", phase="spec_verify", requests=2, query_len=9):
            _route(18)
        with forward_context(decode_backend="latency_specialized", phase="spec_verify", requests=2, query_len=8):
            _route(17)  # more rows than requests x query length: not a step this scope describes
    assert calls == [128]
    assert [d.implementation for d in tr.decisions] == ["latency_specialized", "standard", "standard"]
    assert tr.decisions[0].reason == ("in scope (phase spec_verify, requests 16, query length 8, rows 128, cpu, "
                                      "float32, TP 1, E 32, K 4, G 1, TG 1, B 16)")
    assert tr.decisions[1].reason == "out of declared scope: query length 9 outside [1, 8]"
    assert tr.decisions[2].reason == ("out of declared scope: 17 token rows exceed requests x query length = 2 x 8")


def test_without_requests_a_decode_step_counts_each_row_as_a_request(monkeypatch):
    _install(monkeypatch, OpScope(devices=("cpu",), requests_min=1, requests_max=4))
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        _route(4)
        _route(5)
    assert [(d.implementation, d.requests, d.query_len) for d in tr.decisions] == \
        [("latency_specialized", 4, 1), ("standard", 5, 1)]


@pytest.mark.parametrize("kwargs, msg", [
    ({"phase": "decode", "query_len": 8}, "a decode step has query length 1; got 8"),
    ({"phase": "spec_verify", "requests": 2}, "a spec_verify step needs requests and query_len >= 2"),
    ({"phase": "spec_verify", "requests": 2, "query_len": 1}, "a spec_verify step needs requests and query_len >= 2"),
    ({"phase": "verify"}, "phase 'verify' is not one of"),
    ({"phase": "decode", "requests": 0}, "requests must be an int >= 1 (a count); got 0"),
])
def test_forward_context_refuses_a_step_that_cannot_be(kwargs, msg):
    with pytest.raises(ValueError) as info, forward_context(decode_backend="latency_specialized", **kwargs):
        pass
    assert msg in str(info.value)


@pytest.mark.parametrize("qlens, ctx, spec_rows, want", [
    ([8] * 16, [30] * 16, None, "spec_verify"),  # 16 verifying requests at D = 7: 128 rows, one verification step
    ([8, 3, 1], [30, 31, 32], [True, True, True], "spec_verify"),  # ragged drafts
    ([1] * 16, [30] * 16, None, "decode"),
])
def test_vllm_step_classification_names_verification_steps(qlens, ctx, spec_rows, want):
    assert classify_batch(qlens, ctx, num_spec=7, spec_rows=spec_rows) == want


def test_task_scopes_are_in_requests_and_query_length():
    moe, dspark, gemm, kda = (load_task(ROOT, t) for t in ("k3_moe_dispatch", "k3_dspark_verify", "k3_small_m_gemm",
                                                              "k3_kda_decode"))
    assert (gemm.scope.rows_axis, gemm.scope.query_axis, gemm.scope.phases) == ("M", ("Q", 0), ("decode", "spec_verify"))
    assert gemm.scope.step({"M": 9, "Q": 1, "N": 64, "K": 64}) == ("decode", 9, 1, 9)
    assert gemm.scope.step({"M": 13, "Q": 8, "N": 64, "K": 64}) == ("spec_verify", 2, 8, 13)
    # kda_decode: one call per query position over the step's requests (rows = requests)
    assert (kda.scope.requests_axis, kda.scope.query_axis) == ("B", ("Q", 0))
    assert kda.scope.step({"B": 4, "Q": 8, "H": 4, "K": 64, "V": 64, "S": 5}) == ("spec_verify", 4, 8, 4)
    # every task judges decode and verification steps (dspark_verify: verification steps only)
    for tid in ("k3_moe_dispatch", "k3_small_m_gemm", "k3_lse_merge", "k3_kda_decode", "k3_allreduce_rmsnorm"):
        t = load_task(ROOT, tid)
        steps = {t.scope.step(w.axes, w.phase)[0] for w in t.correctness.workloads}
        assert t.scope.query_len_max == 8 and steps == {"decode", "spec_verify"}, (tid, steps)
    assert (moe.scope.rows_axis, moe.scope.query_axis, moe.scope.phases) == ("T", ("Q", 0), ("decode", "spec_verify"))
    assert (dspark.scope.requests_axis, dspark.scope.query_axis, dspark.scope.phases) == ("B", ("D", 1), ("spec_verify",))
    assert dspark.scope.step({"B": 3, "D": 7, "V": 100, "Q": 1}) == ("spec_verify", 3, 8, 3)
    assert {w.phase for w in dspark.correctness.workloads} == {"spec_verify"}  # the scope's first phase by default


@pytest.mark.parametrize("name, step", [
    ("k3_t64", ("decode", 64, 1, 64)),
    ("k3_r1_d7", ("spec_verify", 1, 8, 8)),  # the seed's headline: batch 1 with 7 drafts
    ("k3_r16_d7", ("spec_verify", 16, 8, 128)),
    ("k3_r64_d7", ("spec_verify", 64, 8, 512)),
    ("k3_t13_d7_ragged", ("spec_verify", 2, 8, 13)),  # ragged: the fewest requests that hold 13 rows
])
def test_moe_workloads_are_decode_and_verification_steps(name, step):
    moe = load_task(ROOT, "k3_moe_dispatch")
    w = moe.workload(name)
    assert moe.scope.step(w.axes, w.phase) == step and w.phase == step[0]


def test_moe_correctness_draws_cover_decode_and_verification_steps():
    from guards.cases import random_workloads

    moe = load_task(ROOT, "k3_moe_dispatch")
    steps = [moe.scope.step(w.axes, w.phase) for w in random_workloads(moe, 5)]
    assert {p for p, *_ in steps} == {"decode", "spec_verify"}
    assert all(1 <= r <= 64 and 1 <= q <= 8 and rows <= r * q for _p, r, q, rows in steps)
    assert any(rows > 64 for *_x, rows in steps)  # rows past any decode step's


def test_perf_draws_stay_on_the_query_lengths_a_kernel_claims():
    from guards.perf import perf_workloads

    moe = load_task(ROOT, "k3_moe_dispatch")
    decode_only = {"query_len_min": 1, "query_len_max": 1}
    verify = {"query_len_min": 1, "query_len_max": 8}
    for seed in (1, 2, 3):
        drawn = perf_workloads(moe, seed, claimed=decode_only)[len(moe.perf.workloads):]
        assert drawn and all(w.axes["Q"] == 1 and w.axes["T"] <= 64 and w.phase == "decode" for w in drawn), \
            [(w.name, w.axes) for w in drawn]
    wide = [w for seed in (1, 2, 3) for w in perf_workloads(moe, seed, claimed=verify)[len(moe.perf.workloads):]]
    assert any(w.axes["Q"] > 1 for w in wide) and all(w.axes["T"] <= 64 * w.axes["Q"] for w in wide)


def _task_file(tmp_path, task_id: str, src: str) -> Path:
    p = tmp_path / task_id / "task.toml"
    p.parent.mkdir()
    p.write_text(src)
    return p


def test_task_with_old_row_fields_is_refused_with_the_replacements(tmp_path):
    src = (ROOT / "tasks/k3_kda_decode/task.toml").read_text()
    bad = src.replace('requests_axis = "B"\nquery_len_axis = "Q"\nrequests_min = 1\nrequests_max = 64\n',
                      'batch_axis = "B"\nquery_len_axis = "Q"\nbatch_min = 1\nbatch_max = 64\n')
    assert bad != src
    with pytest.raises(TaskSpecError) as info:
        load_task_file(_task_file(tmp_path, "k3_kda_decode", bad))
    msg = str(info.value)
    assert "batch_axis, batch_min, batch_max, the token-row fields of before issue 21" in msg, msg
    assert "requests_axis, requests_min, requests_max" in msg and "draft_axis, query_len_min, query_len_max" in msg


@pytest.mark.parametrize("task_id, old, new, msg", [
    ("k3_kda_decode", 'query_len_axis = "Q"\n', "", "query_len_max 8 needs a draft_axis"),
    ("k3_moe_dispatch", 'query_len_axis = "Q"\n', "", "rows_axis 'T' needs a draft_axis or query_len_axis"),
    ("k3_moe_dispatch", 'rows_axis = "T"\n', 'rows_axis = "T"\nrequests_axis = "T"\n',
     "declare exactly one of requests_axis"),
    ("k3_moe_dispatch", 'query_len_axis = "Q"\n', 'query_len_axis = "Q"\ndraft_axis = "Q"\n',
     "declare draft_axis ('Q', query length 1 + D) or query_len_axis ('Q', the query length itself), not both"),
    ("k3_moe_dispatch", 'name = "k3_r64_d7"\naxes = { T = 512,', 'name = "k3_r64_d7"\naxes = { T = 520,',
     "correctness workload 'k3_r64_d7' is a step of 65 requests at query length 8"),
    ("k3_moe_dispatch", 'name = "k3_r1_d7"\n', 'name = "k3_r1_d7"\nphase = "decode"\n',
     "correctness workload 'k3_r1_d7' has phase 'decode' but query length 8 makes it a 'spec_verify' step"),
    ("k3_moe_dispatch", 'phases = ["decode", "spec_verify"]', 'phases = ["spec_verify"]',
     "list \"decode\" exactly when query_len_min is 1"),
])
def test_task_step_fields_must_agree(tmp_path, task_id, old, new, msg):
    src = (ROOT / f"tasks/{task_id}/task.toml").read_text()
    assert old in src
    with pytest.raises(TaskSpecError) as info:
        load_task_file(_task_file(tmp_path, task_id, src.replace(old, new, 1)))
    assert msg in str(info.value), str(info.value)


def test_rows_max_bounds_the_rows_of_a_call_and_is_plain_data(monkeypatch):
    """``rows_max``: a kernel whose gain or workspace follows the rows claims every decode step and the
    verification steps up to its rows (the moe lean kernel: 128 rows, 16 requests at 7 drafts)."""
    scope = OpScope(devices=("cpu",), phases=("decode", "spec_verify"), query_len_max=8, rows_max=128)
    calls = _install(monkeypatch, scope)
    with record_trace() as tr:
        with forward_context(decode_backend="latency_specialized", phase="spec_verify", requests=16, query_len=8):
            _route(128)
        with forward_context(decode_backend="latency_specialized", phase="spec_verify", requests=17, query_len=8):
            _route(136)
        with forward_context(decode_backend="latency_specialized", phase="decode", requests=64):
            _route(64)
    assert calls == [128, 64]
    assert tr.decisions[1].reason == "out of declared scope: 136 token rows above rows_max 128"
    assert scope.to_dict()["rows_max"] == 128 and "rows_max" not in OpScope(devices=("cpu",)).to_dict()
    for bad, got in ((0, "got 0"), (True, "got bool"), (128.0, "got float")):
        with pytest.raises(ScopeError, match=f"'rows_max' must be None or an int >= 1; {got}"):
            OpScope(devices=("cpu",), rows_max=bad)


def test_the_merged_cpu_moe_kernel_claims_what_its_fixture_was_judged_on():
    """k3_model/kernels/moe_dispatch is the lean-torch-cpu fixture (merged): the same scope, verification steps
    up to 512 rows (bench/results/cpu/moe_lean_verification_session22/)."""
    merged = parse_scope(__import__("k3_model.kernels.moe_dispatch", fromlist=["SCOPE"]).SCOPE)
    assert (merged.phases, merged.requests_max, merged.query_len_max, merged.rows_max) == \
        (("decode", "spec_verify"), 64, 8, None)
    fixture = (ROOT / "tasks/k3_moe_dispatch/fixtures/good/lean-torch-cpu/k3_model/kernels/moe_dispatch/__init__.py")
    assert fixture.read_text() == (ROOT / "k3_model/kernels/moe_dispatch/__init__.py").read_text()
