"""Layout overlays (``[domain.overlays.<name>] layout = true``): a draw may reach the kernel with the strides the
contract allows, not only packed (session 21's red team: a small-M GEMM kernel that re-read x as packed rows was
accepted while every draw was packed)."""

from __future__ import annotations

import pytest
import torch

from guards._child_main import _device_copy
from guards.cases import draw_inputs
from tests.conftest import REPO_ROOT
from workbench.errors import TaskSpecError
from workbench.taskspec import load_task


def _workload(task, name):
    return next(w for w in task.correctness.workloads if w.name == name)


def test_a_layout_overlay_keeps_its_strides_and_values():
    task = load_task(REPO_ROOT, "k3_small_m_gemm")
    w = _workload(task, "edge_row_view_k3_m8")
    x = draw_inputs(task, w, 5)["x"]
    assert x.shape == (8, 7168) and not x.is_contiguous() and x.stride(1) == 1 and 7168 < x.stride(0) <= 7168 + 64
    plain = draw_inputs(task, w.model_copy(update={"case": "realistic"}), 5)["x"]
    assert plain.is_contiguous() and torch.equal(plain, x)  # the same values, another layout


def test_the_childs_copies_keep_a_row_view():
    wide = torch.arange(4 * 10, dtype=torch.float32).view(4, 10)
    x = wide[:, 2:9]
    c = _device_copy(x, "cpu")
    assert c.stride() == x.stride() and torch.equal(c, x) and c.data_ptr() != x.data_ptr()
    packed = torch.ones(3, 5)
    assert _device_copy(packed, "cpu").is_contiguous()


def test_an_overlay_that_makes_overlapping_rows_is_the_tasks_error(monkeypatch):
    task = load_task(REPO_ROOT, "k3_small_m_gemm")
    w = _workload(task, "edge_row_view_k3_m8")
    import guards.cases as cases_mod

    real = cases_mod.load_task_module

    class Inputs:
        def __init__(self, mod):
            self.make_inputs = mod.make_inputs

        @staticmethod
        def row_view(inputs, axes, seed):
            x = inputs["x"]
            return {**inputs, "x": x.reshape(-1)[:x.shape[1] + 1].as_strided(x.shape, (1, 1))}

    monkeypatch.setattr(cases_mod, "load_task_module", lambda t, name: Inputs(real(t, name)))
    with pytest.raises(TaskSpecError, match="keep a unit inner stride and rows that do not overlap"):
        draw_inputs(task, w, 5)
