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
