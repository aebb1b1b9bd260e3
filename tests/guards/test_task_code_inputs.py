"""The judge hands the task's reference, check and metamorphic relations its own input tensors, not copies
(``guards.cases.untouched``): a write torch counts is an error there, and no task's code writes its inputs in any
way, including ways torch does not count (checked here bit for bit)."""

from __future__ import annotations

import pytest
import torch

from guards.cases import build_case, load_task_module, untouched
from guards.correctness import same_bits
from tests.conftest import REPO_ROOT
from workbench.errors import TaskSpecError
from workbench.taskspec import list_task_ids, load_task


def _task():
    return load_task(REPO_ROOT, "k3_small_m_gemm")


def test_untouched_returns_what_the_code_returns_when_it_writes_nothing():
    x = torch.arange(6.0)
    assert untouched(_task(), "reference.reference", ({"x": x},), lambda d, s: {"out": d["x"] * s}, {"x": x}, 2.0)["out"].tolist() \
        == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("write, name", [(lambda d: d["x"].mul_(2), "x"), (lambda d: d["x"][1:3].zero_(), "x"),
                                         (lambda d: torch.add(d["x"], 1, out=d["x"]), "x"),
                                         (lambda d: d["w"].copy_(d["x"]), "w")])
def test_untouched_raises_on_an_in_place_write_naming_the_input_and_the_file(write, name):
    inputs = {"x": torch.ones(4), "w": torch.zeros(4), "n": 3}
    with pytest.raises(TaskSpecError) as err:
        untouched(_task(), "reference.check", (inputs,), write, inputs)
    msg = str(err.value)
    assert f"tasks/k3_small_m_gemm/reference.py reference.check wrote its input(s) {name} in place" in msg
    assert "leave the inputs it is given unchanged" in msg


def test_untouched_sees_a_write_into_either_of_two_input_sets():
    a, b = {"x": torch.ones(3)}, {"x": torch.ones(3)}
    with pytest.raises(TaskSpecError, match="wrote its input"):
        untouched(_task(), "reference.permuted_rows", (a, b), lambda p, q: q["x"].neg_(), a, b)


def _smallest_per_regime(task):
    """One correctness workload per input regime (``case``): the one with the fewest input elements."""
    from guards.cases import random_workloads

    best: dict[str, tuple[int, object]] = {}
    for w in [*task.correctness.workloads, *random_workloads(task, 5)]:
        size = 1
        for v in w.axes.values():
            size *= max(int(v), 1)
        if w.case not in best or size < best[w.case][0]:
            best[w.case] = (size, w)
    twins = [w for w in task.correctness.workloads if w.invariance]
    chosen = [w for _, w in best.values()]
    if twins and not any(w.invariance for w in chosen):
        chosen.append(min(twins, key=lambda w: sum(int(v) for v in w.axes.values())))
    return chosen


def _bits(inputs):
    return {k: v.clone() for k, v in inputs.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("task_id", list_task_ids(REPO_ROOT))
def test_no_task_code_writes_its_inputs(task_id):
    task = load_task(REPO_ROOT, task_id)
    ref = load_task_module(task, "reference")
    checked = 0
    for w in _smallest_per_regime(task):
        case = build_case(task, w, 11)
        before_a, before_b = _bits(case.inputs_a), _bits(case.inputs_b)
        want_a = ref.reference(dict(case.inputs_a), dict(case.kwargs))
        want_b = ref.reference(dict(case.inputs_b), dict(case.kwargs))
        if hasattr(ref, "check"):
            assert ref.check(dict(case.inputs_a), dict(case.kwargs), want_a, want_a, task.correctness.tolerance) == []
            wrong = {k: (v.flip(0) + 1 if v.is_floating_point() else v.flip(0) - 1) if isinstance(v, torch.Tensor) and v.numel() > 1
                     else v for k, v in want_b.items()}  # a wrong output: the check's mismatch paths run too
            ref.check(dict(case.inputs_b), dict(case.kwargs), wrong, want_b, task.correctness.tolerance)
        if case.twin is not None:
            getattr(ref, case.twin.relation)(dict(case.inputs_a), want_a, dict(case.inputs_b), want_b,
                                             dict(case.twin.info), dict(case.kwargs), task.correctness.tolerance)
        for before, inputs in ((before_a, case.inputs_a), (before_b, case.inputs_b)):
            changed = [k for k, v in before.items() if not same_bits(inputs[k], v)]
            assert not changed, f"{task_id} {w.name}: task code changed input(s) {changed}"
        checked += 1
    assert checked >= 1
