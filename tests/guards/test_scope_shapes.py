"""Shapes in scope, judged (issue 19 item 1): the activation guard decides "the new path ran" with the
dispatcher's shape rule, rejects shape rules beyond the task's domain like an over-claimed batch
range, and a kernel wrong only outside the shapes it declares is accepted (the dispatcher never
routes those shapes to it), while the same kernel without the declaration is rejected by correctness.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from guards.activation import ActivationGuard, case_shapes, claims, scope_verdict, shape_excess
from guards.base import GuardContext
from guards.correctness import CorrectnessGuard
from guards.isolation import IsolationGuard
from guards.verdict import Status
from k3_model.dispatch import BatchInfo, OpScope, route
from workbench.fixtures import materialize_inject
from workbench.taskspec import eval_constraint, load_task
from workbench.worktree import create_candidate

ROOT = Path(__file__).resolve().parents[2]
AR = "k3_allreduce_rmsnorm"
BASE_SCOPE = {"devices": ["cpu"], "phases": ["decode"], "tp_sizes": [1, 2, 4, 8], "dtypes": ["bfloat16"],
              "requests_min": 1, "requests_max": 64}


@pytest.mark.parametrize("shapes, excess", [
    ({"D": {"max": 16384}}, "shapes D [1, 16384] exceeds the task's domain D [1, 7168]"),
    ({"D": {"choices": (256, 8192)}}, "shapes D choices [8192] not in the task's domain D [1, 7168]"),
    ({"D": {"min": 8000}}, "shapes D {'min': 8000} admits no value of the task's domain D [1, 7168]: the kernel would never run"),
])
def test_shape_rules_beyond_the_tasks_domain_fail_activation(shapes, excess):
    task = load_task(ROOT, AR)
    v = scope_verdict({**BASE_SCOPE, "shapes": shapes}, task, "cpu", [1, 2, 4, 8])
    assert v is not None and v.status is Status.FAIL
    assert v.summary == f"The kernel claims a scope the task does not test: {excess}."
    assert [e.value for e in v.evidence] == [excess]


def test_shape_rules_inside_the_domain_and_old_scopes_pass_the_scope_check():
    task = load_task(ROOT, AR)
    for shapes in ({"D": {"multiple_of": 8}}, {"D": {"choices": (256, 7168)}}, {"D": {"min": 64, "max": 7168}}):
        assert scope_verdict({**BASE_SCOPE, "shapes": shapes}, task, "cpu", [1, 2, 4, 8]) is None
    assert scope_verdict(dict(BASE_SCOPE), task, "cpu", [1, 2, 4, 8]) is None


def test_moe_shape_excess_against_choices():
    task = load_task(ROOT, "k3_moe_dispatch")
    assert shape_excess({"E": {"choices": (32, 896)}, "B": {"max": 64}}, task) == []
    assert shape_excess({"E": {"max": 1024}}, task) == [
        "shapes E [1, 1024] exceeds the task's domain E choices [1, 8, 16, 32, 60, 64, 128, 160, 256, 384, 896]"]
    assert shape_excess({"B": {"multiple_of": 256}}, task) == [
        "shapes B {'multiple_of': 256} admits no value of the task's domain B choices [16, 32, 64, 128]: the kernel "
        "would never run"]


def test_an_unknown_shape_axis_in_the_reported_scope_fails_activation():
    task = load_task(ROOT, AR)
    v = scope_verdict({**BASE_SCOPE, "shapes": {"W": {"max": 4}}}, task, "cpu", [1, 2, 4, 8])
    assert v.status is Status.FAIL
    assert v.summary.startswith("The declared scope is not plain data: the declared scope the correctness child "
                                "reported: SCOPE.shapes names axis(es) ['W'] that op 'allreduce_rmsnorm' does not have")


def test_claims_and_the_dispatcher_agree_on_shapes():
    task = load_task(ROOT, AR)
    scope = OpScope(devices=("cpu",), dtypes=("bfloat16",), tp_sizes=(1, 2), shapes={"D": {"multiple_of": 8}})
    for D in (1, 7, 8, 250, 256, 7168, 7169):
        for tp in (1, 2):
            shapes = case_shapes(task, {"W": tp, "T": 4, "D": D})
            assert shapes == {"D": D}
            want = route("allreduce_rmsnorm", scope, BatchInfo("decode", 4, 1, 4, "cpu", "bfloat16", tp, shapes))[0]
            assert want == (D % 8 == 0 and D <= 7168)
            assert claims(scope, phase="decode", requests=4, device="cpu", dtype="bfloat16", tp=tp, op="allreduce_rmsnorm",
                          shapes=shapes) is want


TAIL_BUG = Path("tasks/k3_allreduce_rmsnorm/fixtures/bad/correctness-assumes-hidden-multiple-of-8.inject.toml")
KERNEL = "k3_model/kernels/allreduce_rmsnorm/__init__.py"
OLD_SCOPE = """SCOPE = OpScope(devices=("cpu",), phases=("decode", "spec_verify"), tp_sizes=(1, 2, 4, 8), dtypes=("bfloat16",),
                requests_min=1, requests_max=64, query_len_min=1, query_len_max=8, rows_max=64)"""
TP2_SCOPE = """SCOPE = OpScope(devices=("cpu",), phases=("decode",), tp_sizes=(2,), dtypes=("bfloat16",),
                requests_min=1, requests_max=64)"""
NEW_SCOPE = """SCOPE = OpScope(devices=("cpu",), phases=("decode",), tp_sizes=(2,), dtypes=("bfloat16",),
                requests_min=1, requests_max=64, shapes={"D": {"multiple_of": 8}})"""


def _ctx(repo: Path, tmp_path: Path, src: str, name: str, draws: int = 0, seed: int = 7) -> GuardContext:
    """A candidate of the allreduce task with kernel source ``src``, judged on three TP-2 workloads only
    (one at D = 250) and ``draws`` random draws, so the test stays cheap."""
    overlay = tmp_path / name
    (overlay / KERNEL).parent.mkdir(parents=True)
    (overlay / KERNEL).write_text(src)
    c = create_candidate(repo, AR, str(overlay))
    task = load_task(repo, AR)
    keep = ("k3_w2_t8", "mini_w2_t5", "edge_hidden_250_w2")
    task = task.model_copy(update={"correctness": task.correctness.model_copy(update={
        "random_draws": draws, "workloads": tuple(w for w in task.correctness.workloads if w.name in keep)}),
        "domain": task.domain.model_copy(update={"beyond_cost_draws": 0})})  # no draws past the cost cap (W 8)
    ctx = GuardContext(task=task, repo_root=repo, worktree=c.worktree, base_commit=c.base_commit,
                       candidate_commit=c.candidate_commit, device="cpu", seed=seed)
    assert IsolationGuard().check(ctx).status is Status.PASS
    return ctx


@pytest.mark.slow
def test_a_kernel_wrong_only_outside_its_declared_shapes_is_accepted_and_without_the_declaration_rejected(
        project_repo, tmp_path):
    src = (materialize_inject(project_repo / TAIL_BUG) / KERNEL).read_text()
    assert OLD_SCOPE in src
    # as shipped (SCOPE does not exclude D = 250; TP 2 only, as judged here): correctness rejects it there
    ctx = _ctx(project_repo, tmp_path, src.replace(OLD_SCOPE, TP2_SCOPE), "tail-bug")
    v = CorrectnessGuard().check(ctx)
    assert v.status is Status.FAIL
    assert v.summary.startswith("1 of 3 configurations wrong; first: edge_hidden_250_w2 (T=5, 2 ranks): ")
    # declaring D multiple_of 8: the dispatcher sends D = 250 to the standard path, both guards accept, and
    # the configuration's counterpart moved to D = 248 runs the kernel (guards/scope_shapes.py; a random
    # draw's counterpart: test_random_draws_outside_the_declared_shapes_get_a_counterpart_inside)
    ctx = _ctx(project_repo, tmp_path, src.replace(OLD_SCOPE, NEW_SCOPE), "tail-bug-declared", draws=0, seed=1)
    v = CorrectnessGuard().check(ctx)
    assert v.status is Status.PASS, v.summary
    impl = {c["name"]: (c["axes"]["D"], c["implementation"]) for c in ctx.artifacts.cases}
    assert impl == {"k3_w2_t8": (7168, "latency_specialized"), "mini_w2_t5": (256, "latency_specialized"),
                    "edge_hidden_250_w2": (250, "standard"), "edge_hidden_250_w2-in-shapes": (248, "latency_specialized")}
    a = ActivationGuard().check(ctx)
    assert a.status is Status.PASS, a.summary
    assert "ran in all 3 configurations inside its declared scope" in a.summary


def test_random_draws_outside_the_declared_shapes_get_a_counterpart_inside():
    from guards.cases import random_workloads
    from guards.scope_shapes import admitted_near, followups

    task = load_task(ROOT, AR)
    d = task.domain.axes["D"]
    assert admitted_near(d, {"multiple_of": 8}, 250) == [248, 256, 8]
    assert admitted_near(d, {"multiple_of": 8}, 7167) == [7168, 7160, 8]
    assert admitted_near(d, {"multiple_of": 8}, 1) == [8]
    draws = [w for seed in range(4) for w in random_workloads(task, seed)]
    scope = {**BASE_SCOPE, "shapes": {"D": {"multiple_of": 8}}}
    out = followups(task, scope, draws)
    outside = [w for w in draws if w.axes["D"] % 8]
    assert outside and len(out) == len(outside)  # every draw outside has one inside (cost limits allow it)
    for w, m in zip(outside, out):
        assert m.name == w.name + "-in-shapes" and m.axes["D"] % 8 == 0 and abs(m.axes["D"] - w.axes["D"]) < 8
        assert {k: v for k, v in m.axes.items() if k != "D"} == {k: v for k, v in w.axes.items() if k != "D"}
        cap = task.domain.satisfied({**w.axes, **w.params})  # a draw beyond the cost cap stays under the ceiling
        assert m.case == w.case and m.params == w.params and task.domain.satisfied({**m.axes, **m.params}, cost=cap)
        assert all(eval_constraint(c, {**m.axes, **m.params}) for c in task.domain.cost_ceiling)
    assert followups(task, dict(BASE_SCOPE), draws) == []  # no shape rules: nothing to add
    assert followups(task, {**BASE_SCOPE, "shapes": "D%8"}, draws) == []  # not plain data: activation rejects it


@pytest.mark.slow
def test_fixed_edge_workloads_outside_the_declared_shapes_get_a_counterpart_inside():
    """Session 11: a DSpark kernel declaring V >= 4096 left every fixed edge workload (written at V 1024
    or 16) to the standard path, and one accepting u <= p/q (not <) was accepted. The edge cases must
    follow the kernel into its shapes, with their case (the edge data) unchanged."""
    from guards.cases import build_case
    from guards.scope_shapes import followups

    task = load_task(ROOT, "k3_dspark_verify")
    fixed = list(task.correctness.workloads)
    scope = {"devices": ["cpu"], "shapes": {"V": {"min": 4096}}}
    out = {m.name: m for m in followups(task, scope, fixed)}
    small = [w for w in fixed if w.axes["V"] < 4096 and w.case in task.domain.regimes]
    assert {"edge_u_zero", "edge_u_zero_dp", "edge_greedy_ties"} <= {w.name for w in small}
    for w in small:
        m = out[w.name + "-in-shapes"]
        assert m.axes["V"] == 4096 and m.case == w.case and m.params == w.params
        assert {k: v for k, v in m.axes.items() if k != "V"} == {k: v for k, v in w.axes.items() if k != "V"}
        inputs = build_case(task, m, 11).inputs_a  # the regime's generator makes its edge data there
        assert inputs["target_logits"].shape[-1] == 4096
        if w.case == "u_zero":
            assert (inputs["uniform_draws"] == 0).any()
    # a case written for one configuration (an issue's worked example) is not moved: no generator for it
    examples = [w for w in fixed if w.case not in task.domain.regimes]
    assert examples and not any(w.name + "-in-shapes" in out for w in examples)
    assert not any(w.name + "-in-shapes" in out for w in fixed if w.axes["V"] >= 4096)  # inside already


def test_moe_draws_are_moved_to_a_declared_expert_count_that_keeps_the_constraints():
    from guards.cases import random_workloads
    from guards.scope_shapes import followups

    task = load_task(ROOT, "k3_moe_dispatch")
    draws = random_workloads(task, 3)
    scope = {"devices": ["cpu"], "shapes": {"E": {"choices": (32, 896)}}}
    for m in followups(task, scope, draws):
        assert m.axes["E"] in (32, 896) and task.domain.satisfied({**m.axes, **m.params})


def test_a_later_run_of_few_cases_checks_the_scope_against_every_tp_size_judged(monkeypatch, tmp_path):
    """Shrinking or the moved draws run a few cases in a new child; its early scope check must see the
    whole judgment's world sizes, or a kernel claiming TP 1 and 2 is refused on a TP-1-only rerun."""
    import guards.correctness as corr
    from guards.cases import build_case
    from guards.sandbox import ChildOutcome

    task = load_task(ROOT, AR)
    seen = []

    def fake_ranks(worktree, reqs, **kw):
        seen.append([r["scope_limits"]["tp_sizes"] for r in reqs])
        return [ChildOutcome(response={"ok": True, "cases": []}, returncode=0, timed_out=False, duration_s=0.1,
                             stdout_tail="", stderr_tail="", problem=None) for _ in reqs]

    monkeypatch.setattr(corr, "run_ranks", fake_ranks)
    ctx = GuardContext(task=task, repo_root=tmp_path, worktree=tmp_path, base_commit="b" * 40,
                       candidate_commit="c" * 40, device="cpu", seed=1)
    w = task.workload("k3_w1_t1").model_copy(update={"axes": {"W": 1, "T": 1, "Q": 1, "D": 16}})
    c = build_case(task, w, 1)
    corr.CorrectnessGuard()._run(ctx, [c])
    corr.CorrectnessGuard()._run(ctx, [c], tp_sizes=[2, 4])
    assert seen == [[[1]], [[1, 2, 4]]]
