"""bench/mutation_study.py: the mutator's rewrites, what it never touches, sampling, scoring, bit digests,
and one mutant judged end to end by the real correctness guard."""

from __future__ import annotations

import ast
import importlib.util
import sys

import pytest

from tests.conftest import REPO_ROOT

_spec = importlib.util.spec_from_file_location("mutation_study", REPO_ROOT / "bench" / "mutation_study.py")
ms = importlib.util.module_from_spec(_spec)
sys.modules["mutation_study"] = ms
_spec.loader.exec_module(ms)

SRC = '''"""Kernel docstring with 1 + 2 and x < y."""

from __future__ import annotations

import torch

from k3_model.dispatch import OpScope

SCOPE = OpScope(devices=("cpu",), requests_min=1, requests_max=64)
LIMIT = 256


def op(x: int | None, y, n):
    """Docstring 3 * 4."""
    z = x + y * 2.5
    if n <= 0 and not y:
        z -= -1
    return min(z, LIMIT)
'''


def _rewrites(mutants):
    return [(m.line, m.operator, m.original, m.replacement) for m in mutants]


def test_mutator_rewrites_every_operator_kind_once_per_site():
    got = _rewrites(ms.mutants_of(SRC, "k.py"))
    assert got == [
        (10, "const 256 -> 257", "256", "(257)"),
        (15, "binop + -> -", "x + y * 2.5", "(x - y * 2.5)"),
        (15, "binop * -> /", "y * 2.5", "(y / 2.5)"),
        (15, "const 2.5 -> 5.0", "2.5", "(5.0)"),
        (15, "const 2.5 -> -2.5", "2.5", "(-2.5)"),
        (16, "boolop and -> or", "n <= 0 and not y", "(n <= 0 or not y)"),
        (16, "compare <= -> <", "n <= 0", "(n < 0)"),
        (16, "const 0 -> 1", "0", "(1)"),
        (16, "drop unary not", "not y", "(y)"),
        (17, "augassign -= -> +=", "z -= -1", "z += -1"),
        (17, "drop unary -", "-1", "(1)"),
        (17, "const 1 -> 0", "1", "(0)"),
        (18, "call min -> max", "min(z, LIMIT)", "(max(z, LIMIT))"),
    ]


def test_mutants_change_only_their_span_and_parse():
    for m in ms.mutants_of(SRC, "k.py"):
        ast.parse(m.source)
        lines, mlines = SRC.splitlines(), m.source.splitlines()
        assert len(lines) == len(mlines)
        changed = [i + 1 for i, (a, b) in enumerate(zip(lines, mlines)) if a != b]
        assert changed == [m.line], m


def test_mutants_never_touch_scope_imports_docstrings_or_annotations():
    protected = {1, 3, 5, 7, 9, 13, 14}  # docstring, imports, SCOPE, the annotated def line, the function docstring
    muts = ms.mutants_of(SRC, "k.py")
    assert muts and not {m.line for m in muts} & protected
    assert not any("|" in m.original for m in muts)  # `int | None` in the annotation is not an operator site


def test_negative_float_constant_splices_to_the_same_tree():
    m = [m for m in ms.mutants_of("w = x * 1.5\n") if m.operator == "const 1.5 -> -1.5"]
    assert len(m) == 1 and m[0].source == "w = x * (-1.5)\n"


def test_duplicate_mutated_texts_are_dropped():
    # `-1` -> `1` by dropping the minus; no other rewrite gives the same text
    texts = [m.source for m in ms.mutants_of("a = b[-1]\nc = b[-1]\n")]
    assert len(texts) == len(set(texts)) == 4


@pytest.mark.slow
def test_sampling_is_deterministic_and_bounded():
    fx = ms.fixture_dir("k3_moe_dispatch")
    a, pop = ms.sample_mutants("k3_moe_dispatch", fx, 7, 19)
    b, _ = ms.sample_mutants("k3_moe_dispatch", fx, 7, 19)
    c, _ = ms.sample_mutants("k3_moe_dispatch", fx, 7, 20)
    assert len(a) == 7 and pop > 7
    assert [m.to_dict() for m in a] == [m.to_dict() for m in b]
    assert [m.to_dict() for m in a] != [m.to_dict() for m in c]
    assert all(m.path == "k3_model/kernels/moe_dispatch/__init__.py" for m in a)
    everything, pop2 = ms.sample_mutants("k3_moe_dispatch", fx, 10_000, 19)
    assert len(everything) == pop2 == pop


def _rec(cls, before=None, after=None, kind_b=None, kind_a=None):
    return {"class": cls, "before": {"killed_by": before, "kill_kind": kind_b},
            "after": {"killed_by": after, "kill_kind": kind_a}}


def test_score_counts_equivalents_out_and_trivial_kills_separately():
    recs = [
        _rec("killed", "correctness", "correctness", "wrong", "wrong"),
        _rec("killed", "correctness", "correctness", "raised", "raised"),
        _rec("killed", None, "correctness", None, "wrong"),  # only the random draws kill it
        _rec("killed", None, "activation", None, "wrong"),
        _rec("differs_but_passes"),
        _rec("likely_equivalent"),
        _rec("not_run"),
    ]
    b, a = ms.score(recs, "before"), ms.score(recs, "after")
    assert (a["mutants"], a["likely_equivalent"], a["non_equivalent"]) == (6, 1, 5)
    assert (a["killed"], a["trivially_killed"], a["survived"]) == (4, 1, 1)
    assert a["killed_by"] == {"activation": 1, "correctness": 3}
    assert a["by_guard"] == {"activation": 0.2, "correctness": 0.6}
    assert a["killed_fraction"] == 0.8
    assert a["killed_fraction_without_trivial"] == 0.75  # 3 of the 4 non-trivial mutants
    assert a["by_guard_without_trivial"] == {"activation": 0.25, "correctness": 0.5}
    assert (b["killed"], b["killed_fraction"], b["killed_fraction_without_trivial"]) == (2, 0.4, 0.25)


def test_score_of_nothing_has_no_fraction():
    s = ms.score([_rec("likely_equivalent")], "after")
    assert s["non_equivalent"] == 0 and s["killed_fraction"] is None and s["by_guard"] == {}


def test_survivor_class():
    assert ms.survivor_class(True, None) == "killed"
    assert ms.survivor_class(False, None) == "unprobed"
    assert ms.survivor_class(False, {"status": "problem"}) == "unprobed"
    assert ms.survivor_class(False, {"bit_identical": True, "wrong_cases": 0}) == "likely_equivalent"
    assert ms.survivor_class(False, {"bit_identical": False, "wrong_cases": 0}) == "differs_but_passes"
    assert ms.survivor_class(False, {"bit_identical": False, "wrong_cases": 2}) == "wrong_on_probe"


def test_bits_digest_sees_signed_zero_and_nan_payload():
    import torch

    z = torch.tensor([0.0, 1.0])
    assert ms.bits_digest(z) == ms.bits_digest(z.clone())
    assert ms.bits_digest(z) != ms.bits_digest(torch.tensor([-0.0, 1.0]))
    n1 = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    n2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert ms.bits_digest(n1) != ms.bits_digest(n2)
    assert ms.bits_digest(torch.ones(2, dtype=torch.bfloat16)) != ms.bits_digest(torch.ones(2, dtype=torch.float16))
    assert ms.bits_digest(torch.ones(2, 1)) != ms.bits_digest(torch.ones(1, 2))


def test_same_probe_names_the_first_difference():
    call = {"outputs": {"y": "d1"}, "inputs_after": {"x": "d0"}, "error": None}
    a = {"c1": [[call, call, call]]}
    assert ms.same_probe(a, {"c1": [[dict(call), dict(call), dict(call)]]}) == (True, "")
    other = {**call, "outputs": {"y": "d2"}}
    assert ms.same_probe(a, {"c1": [[call, other, call]]}) == (False, "c1 rank 0 call 1: outputs y differs")
    assert ms.same_probe(a, {"c2": [[call]]})[0] is False


def test_study_task_copies_draws_and_time_limit_only():
    from workbench.taskspec import load_task

    task = load_task(REPO_ROOT, "k3_moe_dispatch")
    draws, limit = task.correctness.random_draws, task.timeouts.correctness_s
    before = ms.study_task(task, "before", child_timeout_s=60)
    after = ms.study_task(task, "after", child_timeout_s=60)
    probe = ms.study_task(task, "probe", child_timeout_s=60, probe_draws=100)
    assert (before.correctness.random_draws, after.correctness.random_draws, probe.correctness.random_draws) == \
        (0, draws, 100)
    assert before.timeouts.correctness_s == 60 and before.correctness.workloads == task.correctness.workloads
    assert (task.correctness.random_draws, task.timeouts.correctness_s) == (draws, limit)  # the original is untouched


@pytest.mark.slow
def test_one_mutant_is_killed_by_the_real_correctness_guard():
    fx = ms.fixture_dir("k3_moe_dispatch")
    rel = "k3_model/kernels/moe_dispatch/__init__.py"
    m = next(m for m in ms.mutants_of((fx / rel).read_text(), rel)
             if m.original == "scores + e_score_correction_bias" and m.operator == "binop + -> -")
    rec = ms.judge(ms.JudgeJob(key="t", task_id="k3_moe_dispatch", seed=19, files={rel: m.source},
                               child_timeout_s=120, modes=("before", "after", "probe")))
    assert rec["before"]["killed_by"] == "correctness" and rec["before"]["kill_kind"] == "wrong"
    assert rec["before"]["verdicts"][0]["status"] == "FAIL" and rec["before"]["random_cases"] == 0
    assert rec["after"]["inferred_from"] == "before" and "probe" not in rec
