"""CuTe DSL-aware checks that need no GPU to test (issue 13 item 2).

- the correctness guard's CUDA-graph replay comparison (``guards.correctness.graph_mismatches``): a replay
  that left the outputs stale or poisoned fails with a message naming the escaped capture; a replay
  that matches passes; CPU runs and cases on the standard path want no replay;
- the perf guard's compile accounting (``guards.perf.timed_compile_problem``, ``PerfStatus.COMPILED_TIMED``):
  compiles during the warm-up calls are accepted, one in a timed call fails;
- the child's compile counter (``_CountedCompile``, ``_CuteCompileWatch``) on a stand-in ``cutlass.cute``;
- the two CUDA-only bad fixtures: declared in ``requires.toml`` (skipped on CPU) and clean to the audit.

The GPU side (capture and replay, a real ``cute.compile``) is judged on the H200:
``bench/results/h200/cutedsl/`` (README there).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from guards._protocol import tensor_digest
from guards.audit import audit_file
from guards.cases import correctness_cases, load_task_module
from guards.correctness import GRAPH_HINT, CorrectnessGuard, graph_check_wanted, graph_mismatches
from guards.judge import SideRecord
from guards.perf import timed_compile_problem
from guards.perf_status import PerfStatus
from tests.conftest import REPO_ROOT
from workbench.fixtures import list_fixtures
from workbench.taskspec import load_task

TASK = load_task(REPO_ROOT, "k3_moe_dispatch")
REF = load_task_module(TASK, "reference")
BAD = REPO_ROOT / "tasks" / "k3_moe_dispatch" / "fixtures" / "bad"
NEW_FIXTURES = ("correctness-cutedsl-default-stream", "perf-cutedsl-compiles-in-timed-call")
KERNEL_TRACE = [{"op": "moe_dispatch", "implementation": "latency_specialized"}]
STANDARD_TRACE = [{"op": "moe_dispatch", "implementation": "standard"}]


@pytest.fixture(scope="module")
def case():
    """A fixed workload whose two draws route differently (so a stale replay is visible)."""
    c = next(c for c in correctness_cases(TASK, 7) if not c.name.startswith("random-"))
    return c


def _want(case, which):
    inputs = case.inputs_a if which == "a" else case.inputs_b
    return REF.reference({k: v.clone() for k, v in inputs.items()}, dict(case.kwargs))


def _result(case, graph, trace=KERNEL_TRACE):
    calls = [{"label": lab, "trace": trace, "error": None} for lab in ("a_fresh", "b_reused_buffers", "a_repeat")]
    out = {"name": case.name, "calls": calls}
    if graph is not None:
        out["graph"] = graph
    return out


def _graph(outputs, inputs, **kw):
    return {"label": "graph_replay", "error": None, "stage": None, "trace": KERNEL_TRACE,
            "outputs": {k: v.clone() for k, v in outputs.items()},
            "inputs_after": {k: tensor_digest(v) for k, v in inputs.items()}, **kw}


def test_graph_check_wanted_on_cuda_single_process_only():
    assert graph_check_wanted(TASK, "cuda") and not graph_check_wanted(TASK, "cpu")
    dist = load_task(REPO_ROOT, "k3_allreduce_rmsnorm")
    assert not graph_check_wanted(dist, "cuda")


def test_a_replay_that_matches_passes(case):
    want_b = _want(case, "b")
    assert graph_mismatches(TASK, REF, case, _result(case, _graph(want_b, case.inputs_b)), want_b, "cuda") == []


def test_a_stale_replay_fails_naming_the_escaped_capture(case):
    # what a launch that escaped capture leaves: the outputs of the capture-time inputs (or the poison)
    want_a, want_b = _want(case, "a"), _want(case, "b")
    assert not all(torch.equal(want_a[k], want_b[k]) for k in want_a), "the two draws must differ"
    lines = graph_mismatches(TASK, REF, case, _result(case, _graph(want_a, case.inputs_b)), want_b, "cuda")
    assert lines and lines[0].startswith("[graph_replay] the CUDA-graph replay differs from the reference")
    assert GRAPH_HINT in lines[0] and "default stream" in lines[0] and "escaped graph capture" in lines[0]


def test_a_poisoned_replay_fails(case):
    want_b = _want(case, "b")
    poisoned = {k: torch.full_like(v, -7) if not v.is_floating_point() else torch.full_like(v, float("nan"))
                for k, v in want_b.items()}
    lines = graph_mismatches(TASK, REF, case, _result(case, _graph(poisoned, case.inputs_b)), want_b, "cuda")
    assert lines and "differs from the reference" in lines[0]


def test_a_capture_that_raised_fails_with_its_stage(case):
    want_b = _want(case, "b")
    g = _graph(want_b, case.inputs_b, error="RuntimeError: operation not permitted when stream is capturing\n...",
               stage="capture")
    lines = graph_mismatches(TASK, REF, case, _result(case, g), want_b, "cuda")
    assert lines == [f"[graph_replay] the CUDA graph's capture raised RuntimeError: operation not permitted when "
                     f"stream is capturing (capture-unsafe code; {GRAPH_HINT})"]


def test_a_replay_that_mutates_its_inputs_fails(case):
    want_b = _want(case, "b")
    changed = {k: v.clone() for k, v in case.inputs_b.items()}
    changed["router_logits"] = changed["router_logits"] + 1.0
    lines = graph_mismatches(TASK, REF, case, _result(case, _graph(want_b, changed)), want_b, "cuda")
    assert lines[0] == "[graph_replay] the CUDA-graph replay mutated input(s) router_logits"


def test_a_missing_replay_fails_only_when_the_kernel_ran(case):
    want_b = _want(case, "b")
    lines = graph_mismatches(TASK, REF, case, _result(case, None), want_b, "cuda")
    assert lines == ["[graph_replay] the child returned no CUDA-graph replay result, though the eager calls ran "
                     "the candidate's kernel"]
    # the standard path (outside the declared scope) is not the candidate's to capture
    assert graph_mismatches(TASK, REF, case, _result(case, None, STANDARD_TRACE), want_b, "cuda") == []
    # on CPU nothing is captured and nothing is wanted
    assert graph_mismatches(TASK, REF, case, _result(case, None), want_b, "cpu") == []


def test_judge_case_adds_the_graph_lines_on_cuda_only(case):
    want_a, want_b = _want(case, "a"), _want(case, "b")
    rc = _result(case, _graph(want_a, case.inputs_b))
    for call, inputs, want in zip(rc["calls"], (case.inputs_a, case.inputs_b, case.inputs_a), (want_a, want_b, want_a)):
        call["outputs"] = {k: v.clone() for k, v in want.items()}
        call["inputs_after"] = {k: tensor_digest(v) for k, v in inputs.items()}
    guard = CorrectnessGuard()
    mism_cuda, _, _ = guard._judge_case(TASK, REF, case, [rc], "cuda")
    mism_cpu, _, _ = guard._judge_case(TASK, REF, case, [rc], "cpu")
    assert mism_cpu == [] and mism_cuda and all(m.startswith("[graph_replay]") for m in mism_cuda)


# ------------------------------------------------------------------------------ compile accounting

def test_compiles_in_warmup_are_accepted():
    assert timed_compile_problem([1, 0, 1] + [0] * 17 + [0] * 150, 20) == ""
    assert timed_compile_problem([], 20) == ""


def test_a_compile_in_a_timed_call_is_named():
    compiles = [1] + [0] * 19 + [0] * 29 + [1] + [0] * 49 + [2] + [0] * 50
    msg = timed_compile_problem(compiles, 20)
    assert msg == ("compiled inside a timed call: 3 CuTe DSL compile(s) in 2 timed call(s), the first in timed call "
                   "29 (1); compile once per compile-time key before timing (warm-up), as "
                   "kernels.cutedsl.CompileCache does")


def test_compiled_timed_status_fails_and_reads():
    st = PerfStatus.COMPILED_TIMED
    assert st.failing and not st.timing_only and not st.load_sensitive
    r = {"implementation": "latency_specialized (compiled inside a timed call: 1 ...)", "baseline_us": (1.0,),
         "candidate_us": (1.0,), "speedup": 1.0, "speedup_ci": (1.0, 1.0)}
    assert st.problem(r) is None
    assert st.describe(r, min_speedup=1.05).startswith("compiled inside a timed call [")
    assert st.problem({**r, "implementation": "latency_specialized"}) is not None


def test_side_record_keeps_compiles_across_rounds():
    a, b = SideRecord(compiles=[1, 0]), SideRecord(compiles=[0, 3])
    a.extend(b)
    assert a.compiles == [1, 0, 0, 3]


def _child_main():
    spec = importlib.util.spec_from_file_location("_wb_test_child_main", REPO_ROOT / "guards" / "_child_main.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_child_counts_cute_compile_calls_on_import(tmp_path, monkeypatch):
    """A stand-in ``cutlass.cute`` imported after the watch is armed: its ``compile`` (and ``compile[opts]``)
    is counted, and still returns what the real one returns."""
    pkg = tmp_path / "cutlass"
    (pkg / "cute").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "cute" / "__init__.py").write_text(
        "class _C:\n"
        "    def __call__(self, f, *a, **k):\n        return ('compiled', f)\n"
        "    def __getitem__(self, opts):\n        return lambda f, *a, **k: ('compiled-with', opts, f)\n"
        "    version = 'stand-in'\n"
        "compile = _C()\n")
    for m in ("cutlass", "cutlass.cute"):
        monkeypatch.delitem(sys.modules, m, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    child = _child_main()
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    child._watch_cute_compile()
    import cutlass.cute as cute

    assert isinstance(cute.compile, child._CountedCompile)
    assert cute.compile("k") == ("compiled", "k") and child._COMPILES[0] == 1
    assert cute.compile["--opt"]("k") == ("compiled-with", "--opt", "k") and child._COMPILES[0] == 2
    assert cute.compile.version == "stand-in"
    child._watch_cute_compile()  # already imported: wrapped in place, never twice
    cute.compile("k")
    assert child._COMPILES[0] == 3
    for m in ("cutlass", "cutlass.cute"):
        sys.modules.pop(m, None)


# ------------------------------------------------------------------------------ the new fixtures

def test_new_fixtures_are_cuda_only_and_skipped_on_cpu():
    fxs = {f.name: f for f in list_fixtures(TASK)}
    for name in NEW_FIXTURES:
        assert fxs[name].devices == ("cuda",) and not fxs[name].runs_on("cpu") and not fxs[name].good
    assert fxs["correctness-cutedsl-default-stream"].expected_guard == "correctness"
    assert fxs["perf-cutedsl-compiles-in-timed-call"].expected_guard == "perf"


@pytest.mark.parametrize("name", NEW_FIXTURES)
def test_new_fixtures_pass_the_audit(name):
    """The intended runtime guard, not the audit, must reject them: the source holds no known pattern."""
    root = BAD / name
    for path in sorted(Path(root).rglob("*.py")):
        rel = str(path.relative_to(root))
        assert audit_file(rel, path.read_bytes(), tensor_names=set(TASK.inputs) | set(TASK.outputs),
                          target=TASK.target) == [], rel


def test_result_file_keeps_the_graph_timings(case):
    """The correctness guard's case entry with its graph timings is a valid ``CaseResult`` (the H200 run of
    this change first failed here: ``bench/results/h200/cutedsl/graph_compile/run_log.txt``)."""
    from workbench.results import CaseResult

    entry = {"name": case.name, "axes": dict(case.workload.axes), "params": dict(case.kwargs),
             "case": case.workload.case, "implementation": "latency_specialized", "passed": True,
             "mismatches": (), "calls": 3, "world_size": 1,
             "graph_replay": {"capture_ms": 1.24, "replay_ms": 0.03}}
    r = CaseResult(**entry)
    assert r.graph_replay == {"capture_ms": 1.24, "replay_ms": 0.03}
    assert CaseResult(**{k: v for k, v in entry.items() if k != "graph_replay"}).graph_replay is None
