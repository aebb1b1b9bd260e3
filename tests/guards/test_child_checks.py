"""The guard child's own checks (``guards/_child_main.py``): the after-call check for replaced
harness functions (``_patched``), whose fast path (a namespace whose values are all the same objects is not
re-read) finds every replacement the full snapshot finds, on the first check and on every later one, and runs
no candidate code while it reads."""

from __future__ import annotations

import importlib.util
import sys
import types

from tests.conftest import REPO_ROOT


def _child_main():
    spec = importlib.util.spec_from_file_location("_wb_test_child_main_patch", REPO_ROOT / "guards" / "_child_main.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # the check watches its own module (``sys.modules[__name__]``)
    spec.loader.exec_module(mod)
    return mod


def _watched():
    m = types.ModuleType("wb_watched_probe")
    m.clock = lambda: 1.0
    m.counter = 0  # data, not a callable: changing it is not a patch
    return m


def test_a_replaced_function_is_found_on_every_check_after_clean_ones():
    child, m = _child_main(), _watched()
    before = child._snapshot([m])
    assert child._patched(before, [m]) == []  # the full path, then the namespaces are remembered
    assert child._patched(before, [m]) == []  # the fast path
    m.counter += 1  # a value changed, no callable: the full path again, still nothing
    assert child._patched(before, [m]) == []
    m.clock = lambda: 0.0
    assert child._patched(before, [m]) == ["wb_watched_probe.clock"]
    assert child._patched(before, [m]) == ["wb_watched_probe.clock"]  # still found: never remembered as clean


def test_a_function_removed_or_replaced_in_torch_is_found():
    import torch

    child, m = _child_main(), _watched()
    before = child._snapshot([m])
    assert child._patched(before, [m]) == [] and child._patched(before, [m]) == []
    real = torch.Tensor.backward
    try:
        torch.Tensor.backward = lambda self, *a, **k: None
        assert child._patched(before, [m]) == ["Tensor.backward"]  # a class is named by its __name__
    finally:
        torch.Tensor.backward = real
    assert child._patched(before, [m]) == []
    del m.clock
    assert child._patched(before, [m]) == ["wb_watched_probe.clock"]


def test_the_fast_path_agrees_with_the_full_snapshot_when_a_namespace_gains_a_name():
    child, m = _child_main(), _watched()
    before = child._snapshot([m])
    assert child._patched(before, [m]) == []
    m.helper = lambda: None  # new names are not patches (as before the fast path)
    assert child._patched(before, [m]) == []
    assert child._patched(before, [m]) == []


def test_the_check_runs_no_candidate_code_while_it_reads_the_namespaces():
    """helper-35's review (session 28): a value whose ``__class__`` is a property ran candidate code inside the
    snapshot's ``isinstance``; it swapped a function after the snapshot had read it, and the fast path then
    remembered the swapped one as clean. The check now reads each namespace once, by type and identity only."""
    child, m = _child_main(), _watched()
    fired = []

    class Trigger:  # not callable; isinstance() asks its __class__
        @property
        def __class__(self):
            fired.append(1)
            m.clock = lambda: 0.0
            return Trigger

    m.trigger = Trigger()
    before = child._snapshot([m])
    for _ in range(3):
        assert child._patched(before, [m]) == []
    assert fired == []  # never asked
    m.clock = lambda: 2.0
    assert child._patched(before, [m]) == ["wb_watched_probe.clock"]


def test_a_namespace_given_another_class_is_reported_without_reading_it():
    child, m = _child_main(), _watched()
    before = child._snapshot([m])
    assert child._patched(before, [m]) == []

    class Sneaky(types.ModuleType):
        @property
        def __dict__(self):  # a clean-looking namespace for whoever reads __dict__
            raise AssertionError("the check read a namespace whose class changed")

    m.__class__ = Sneaky
    found = child._patched(before, [m])  # its class, and every function it can no longer vouch for
    assert found[0] == "wb_watched_probe.__class__" and "wb_watched_probe.clock" in found


# ---- the correctness child's reading of a call's inputs and outputs (helper-38's review, session 29) ----------


def _run_case(kernel):
    import contextlib

    import torch

    from guards import _protocol as P

    child = _child_main()
    child._bind_torch()
    child._call_threads = lambda: (1, 1, 1)
    child._after_call_problem = lambda: None  # the patch and thread checks are tested above; this is about reading

    class Trace:
        decisions: list = []

    case = {"name": "c", "phase": "decode", "kwargs": {},
            "outputs": {"out": {"shape": [8, 8], "dtype": "float32", "poison": 0.0}},
            "inputs_a": {"x": torch.randn(8, 8)}, "inputs_b": {"x": torch.randn(8, 8)}}
    res = child._correctness_case(kernel, lambda **k: contextlib.nullcontext(), lambda: contextlib.nullcontext(Trace()),
                                  {"device": "cpu", "decode_backend": "standard", "op": "o"}, case)
    unchanged = {r["label"]: r["inputs_after"].get("x") == P.tensor_digest(
        case["inputs_b" if r["label"] == "b_reused_buffers" else "inputs_a"]["x"]) for r in res["calls"]}
    return res["calls"], unchanged


def test_an_input_write_hidden_behind_an_attribute_of_the_tensor_is_seen():
    def kernel(x, out):
        out.copy_(x * 2)
        snap = x.clone()
        x.zero_()  # writes its input
        x.detach = lambda *a, **k: snap  # and shadows detach on the object, so a digest reading x.detach() sees snap

    calls, unchanged = _run_case(kernel)
    assert unchanged == {"a_fresh": False, "b_reused_buffers": False, "a_repeat": False}


def test_an_input_or_output_turned_into_another_class_is_an_error_and_never_read_through_it():
    import torch

    read, inside = [], []

    class Lying(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if not inside:  # called by the harness, not by the kernel itself
                read.append(getattr(func, "__name__", str(func)))
            return super().__torch_function__(func, types, args, kwargs or {})

    def kernel(x, out):
        inside.append(1)
        out.copy_(x * 2)
        x.__class__ = Lying
        inside.clear()

    calls, _ = _run_case(kernel)
    assert all("changed the class of x (now Lying)" in c["error"] for c in calls), [c["error"] for c in calls]
    assert all(c["outputs"] == {} for c in calls)
    assert read == []  # nothing of the harness went through Lying's __torch_function__
