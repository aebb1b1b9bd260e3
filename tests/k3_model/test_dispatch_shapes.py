"""Shapes in scope (issue 19 item 1): a kernel's ``SCOPE.shapes`` and each op's judged shape domain.

The dispatcher routes a call whose shape axes fall outside either to the standard path, with a logged
reason naming the axis, its value and the declared set; malformed shape declarations are clear errors;
each op's ``SHAPE_DOMAIN`` mirrors its task's ``[domain.axes]``.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest
import torch

from k3_model import dispatch
from k3_model.dispatch import DispatchError, OpScope, ScopeError, forward_context, parse_scope, record_trace
from k3_model.ops import allreduce_rmsnorm, moe_dispatch
from k3_model.ops.moe_dispatch import align_capacity, moe_route_dispatch
from workbench.taskspec import list_task_ids, load_task

ROOT = Path(__file__).resolve().parents[2]
TASK_IDS = list_task_ids(ROOT)  # every task folder; its op module is k3_model.ops.<task.op>


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_each_ops_shape_domain_mirrors_its_tasks_domain_axes(task_id):
    task = load_task(ROOT, task_id)
    mod = importlib.import_module(f"k3_model.ops.{task.op}")
    world = task.distributed.world_size_axis if task.distributed else None
    want = {}
    for axis, spec in task.domain.axes.items():
        if axis in (task.scope.batch_axis, task.scope.query_len_axis, world):  # the step axes and the TP size
            continue
        want[axis] = {"choices": tuple(spec.choices)} if spec.choices is not None else {"min": spec.min, "max": spec.max}
    assert mod.SHAPE_DOMAIN == want
    assert dispatch.op_shape_domain(task.op) == want  # what the module registered


def test_shape_rules_are_normalised_and_reported_only_when_declared():
    s = OpScope(devices=("cpu",), shapes={"D": {"max": 4096, "multiple_of": 8, "choices": [256, 256, 7168, 4096]}})
    assert s.shapes == {"D": {"choices": (256, 7168, 4096), "max": 4096, "multiple_of": 8}}
    assert s.to_dict()["shapes"] == s.shapes
    assert "shapes" not in OpScope(devices=("cpu",)).to_dict()  # an old scope reads as before
    raw = {"D": {"multiple_of": 8}}
    s2 = parse_scope({"devices": ("cpu",), "shapes": raw}, op="allreduce_rmsnorm")
    raw["D"]["multiple_of"] = 1  # a later change to the kernel's literal changes nothing
    assert s2.shapes == {"D": {"multiple_of": 8}}


@pytest.mark.parametrize("shapes, message", [
    ([("D", 8)], "OpScope field 'shapes' must be a plain dict of axis name -> rule dict; got list."),
    ({"D": 8}, "OpScope shapes['D'] must be a non-empty plain dict with keys among choices, min, max, multiple_of; got int."),
    ({"D": {}}, "OpScope shapes['D'] must be a non-empty plain dict with keys among choices, min, max, multiple_of; got an empty dict."),
    ({"D": {"multiple": 8}}, "OpScope shapes['D'] has unknown key(s) ['multiple']; expected keys among choices, min, max, multiple_of."),
    ({"D": {"multiple_of": True}}, "OpScope shapes['D']['multiple_of'] must be a plain int >= 1 (a size); got bool."),
    ({"D": {"max": 0}}, "OpScope shapes['D']['max'] must be a plain int >= 1 (a size); got 0."),
    ({"D": {"choices": ()}}, "OpScope shapes['D']['choices'] must be a non-empty plain tuple of int; got tuple (empty)."),
    ({"D": {"choices": (8, 9.0)}}, "OpScope shapes['D']['choices'] item 1 must be a plain int >= 1 (a size); got float."),
    ({"D": {"min": 9, "max": 8}}, "OpScope shapes['D']: min 9 is above max 8; the kernel could never run."),
    ({"D": {"min": 9, "max": 15, "multiple_of": 8}}, "OpScope shapes['D']: no multiple of 8 lies in [9, 15]"),
    ({"D": {"choices": (250,), "multiple_of": 8}}, "OpScope shapes['D']: no listed choice meets the other rules"),
    ({3: {"max": 8}}, "OpScope shapes: axis name 3 must be a plain str naming one of the op's shape axes"),
])
def test_malformed_shape_declarations_are_clear_errors(shapes, message):
    with pytest.raises(ScopeError) as info:
        OpScope(devices=("cpu",), shapes=shapes)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("axis, why", [
    ("T", "SCOPE.shapes names axis(es) ['T'] that op 'allreduce_rmsnorm' does not have; its shape axes are ['D']"),
    ("hidden", "SCOPE.shapes names axis(es) ['hidden'] that op 'allreduce_rmsnorm' does not have"),
])
def test_a_shape_axis_the_op_does_not_have_is_refused(axis, why):
    with pytest.raises(ScopeError, match="query_len_min/query_len_max and tp_sizes") as info:
        parse_scope({"devices": ("cpu",), "shapes": {axis: {"max": 64}}}, where="K", op="allreduce_rmsnorm")
    assert str(info.value).startswith(f"K: {why}")


OPMOD = "k3_model.kernels.moe_dispatch"


@pytest.fixture
def moe_kernel(monkeypatch):
    """Install a fake merged moe_dispatch kernel with a settable SCOPE; yields (module, calls)."""
    calls = []

    def entry(router_logits, e_score_correction_bias, token_valid, **kw):
        calls.append(tuple(router_logits.shape))
        moe_dispatch.moe_route_dispatch_standard(router_logits, e_score_correction_bias, token_valid, **kw)

    mod = types.ModuleType(OPMOD)
    mod.__file__ = "<fake>"
    mod.SCOPE = OpScope(devices=("cpu",))
    mod.moe_route_dispatch = entry
    monkeypatch.setitem(sys.modules, OPMOD, mod)
    monkeypatch.setattr(dispatch, "_MODULES", {})
    yield mod, calls
    dispatch._MODULES.clear()


def _moe(T: int, E: int, K: int = 4, B: int = 16) -> None:
    cap, nb = align_capacity(T, K, E, B)
    moe_route_dispatch(torch.randn(T, E), torch.zeros(E), torch.ones(T, dtype=torch.bool), top_k=K, n_group=1,
                       topk_group=1, renormalize=True, routed_scaling_factor=1.0, block_size=B,
                       topk_weights=torch.empty(T, K), topk_ids=torch.empty(T, K, dtype=torch.int32),
                       sorted_token_ids=torch.empty(cap, dtype=torch.int32), expert_ids=torch.empty(nb, dtype=torch.int32),
                       num_tokens_post_padded=torch.empty(1, dtype=torch.int32))


def test_declared_shapes_route_other_shapes_to_the_standard_path_with_the_axis_named(moe_kernel):
    mod, calls = moe_kernel
    mod.SCOPE = OpScope(devices=("cpu",), shapes={"E": {"choices": (32,)}, "B": {"min": 16, "max": 32}})
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        _moe(4, 32)
        _moe(4, 64)
        _moe(4, 32, B=64)
    assert tr.implementations() == ["latency_specialized", "standard", "standard"]
    assert calls == [(4, 32)]
    assert tr.decisions[0].reason == ("in scope (phase decode, requests 4, query length 1, rows 4, cpu, float32, TP 1, E 32, K 4, G 1, TG 1, B 16)")
    assert tr.decisions[1].reason == "out of declared scope: shape E 64 not in [32] (SCOPE.shapes['E'] = {'choices': (32,)})"
    assert tr.decisions[2].reason == ("out of declared scope: shape B 64 above 32 "
                                      "(SCOPE.shapes['B'] = {'min': 16, 'max': 32})")


def test_a_call_outside_the_judged_domain_never_reaches_a_kernel_even_with_an_old_scope(moe_kernel):
    _, calls = moe_kernel  # SCOPE without shapes: every shape of the task's domain
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        _moe(3, 32)
        _moe(3, 48)  # a legal op call (48 experts), but no kernel was judged at E = 48
        _moe(3, 32, B=8)  # block size 8: legal for the op, outside the judged tiles
    assert tr.implementations() == ["latency_specialized", "standard", "standard"]
    assert calls == [(3, 32)]
    assert tr.decisions[1].reason.startswith("outside the judged shape domain: E 48 not in [1, 8, 16, 32, 60, 64, "
                                             "128, 160, 256, 384, 896] (k3_model.ops.moe_dispatch SHAPE_DOMAIN, the "
                                             "task's [domain.axes.E]); no kernel was judged there")
    assert tr.decisions[2].reason.startswith("outside the judged shape domain: B 8 not in [16, 32, 64, 128]")


def test_a_scope_naming_an_unknown_axis_fails_at_the_first_call_not_silently(moe_kernel):
    mod, calls = moe_kernel
    mod.SCOPE = {"devices": ("cpu",), "shapes": {"experts": {"max": 64}}}
    with forward_context(decode_backend="latency_specialized", phase="decode"):
        with pytest.raises(ScopeError, match=r"names axis\(es\) \['experts'\] that op 'moe_dispatch' does not have; "
                                             r"its shape axes are \['E', 'K', 'G', 'TG', 'B'\]"):
            _moe(2, 32)
    assert calls == []


def test_an_op_that_does_not_report_its_registered_axes_is_a_dispatch_error():
    with pytest.raises(DispatchError, match=r"reports shape axes \['E'\] but the op registered \['B', 'E', 'G', 'K', 'TG'\]"):
        dispatch.select("moe_dispatch", "moe_route_dispatch", lambda: None, rows=1, device="cpu",
                        dtype="float32", shapes={"E": 32})


ARMOD = "k3_model.kernels.allreduce_rmsnorm"


def test_hidden_size_multiple_of_8_kernel_gets_only_those_sizes(monkeypatch):
    """The issue's case: a kernel declaring D multiple_of 8 never sees D = 250 (world size 1, no group)."""
    seen = []

    def entry(x, residual, weight, *, eps, group=None):
        seen.append(x.shape[1])
        allreduce_rmsnorm.allreduce_add_rmsnorm_standard(x, residual, weight, eps=eps, group=group)

    mod = types.ModuleType(ARMOD)
    mod.__file__ = "<fake>"
    mod.SCOPE = OpScope(devices=("cpu",), dtypes=("bfloat16",), shapes={"D": {"multiple_of": 8}})
    mod.allreduce_add_rmsnorm = entry
    monkeypatch.setitem(sys.modules, ARMOD, mod)
    monkeypatch.setattr(dispatch, "_MODULES", {})
    with record_trace() as tr, forward_context(decode_backend="latency_specialized", phase="decode"):
        for D in (256, 250, 7168, 7169):
            x, r = torch.randn(2, D).bfloat16(), torch.randn(2, D).bfloat16()
            allreduce_rmsnorm.allreduce_add_rmsnorm(x, r, torch.ones(D).bfloat16(), eps=1e-5)
    dispatch._MODULES.clear()
    assert seen == [256, 7168]
    assert tr.implementations() == ["latency_specialized", "standard", "latency_specialized", "standard"]
    assert "shape D 250 not a multiple of 8" in tr.decisions[1].reason
    assert tr.decisions[3].reason.startswith("outside the judged shape domain: D 7169 above 7168")
