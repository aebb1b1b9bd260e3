"""Guards on small hand-made candidates: crashes, hangs, unwritten outputs, exceptions, scope claims,
and the pipeline's ERROR/SKIP policy."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest

from guards.activation import ActivationGuard, scope_excess
from guards.artifacts import Artifacts
from guards.base import GuardContext
from guards.correctness import CorrectnessGuard
from guards.isolation import IsolationGuard
from guards.perf import PERF_DOMAIN_DRAWS, PERF_RANDOM_DRAWS
from guards.verdict import Evidence, Status, Verdict
from workbench.errors import WorkbenchError
from workbench.pipeline import is_accepted, run_guards
from workbench.results import read_result
from workbench.taskspec import load_task
from workbench.worktree import create_candidate

GOOD = Path("tasks/k3_moe_dispatch/fixtures/good/lean-torch-cpu/k3_model/kernels/moe_dispatch/__init__.py")
HEADER = '''
import torch
from k3_model.dispatch import OpScope
SCOPE = OpScope(devices=("cpu",), requests_min=1, requests_max=64)
'''


def _candidate(repo: Path, tmp_path: Path, body: str, name: str) -> GuardContext:
    overlay = tmp_path / name
    f = overlay / "k3_model/kernels/moe_dispatch/__init__.py"
    f.parent.mkdir(parents=True)
    f.write_text(body)
    c = create_candidate(repo, "k3_moe_dispatch", str(overlay))
    task = load_task(repo, "k3_moe_dispatch")
    # keep these runs small: fixed workloads only, a short timeout
    task = task.model_copy(update={
        "correctness": task.correctness.model_copy(update={"random_draws": 0}),
        "timeouts": task.timeouts.model_copy(update={"correctness_s": 20.0}),
    })
    ctx = GuardContext(task=task, repo_root=repo, worktree=c.worktree, base_commit=c.base_commit,
                       candidate_commit=c.candidate_commit, device="cpu", seed=123)
    assert IsolationGuard().check(ctx).status is Status.PASS  # records the changed paths
    return ctx


@pytest.mark.slow
def test_candidate_exception_is_fail_with_the_error(project_repo, tmp_path):
    ctx = _candidate(project_repo, tmp_path, HEADER + "def moe_route_dispatch(*a, **k):\n    raise NotImplementedError('todo')\n", "raises")
    v = CorrectnessGuard().check(ctx)
    assert v.status is Status.FAIL
    assert "raised NotImplementedError: todo" in v.summary


@pytest.mark.slow
def test_unwritten_output_is_caught_by_poison(project_repo, tmp_path):
    src = (project_repo / GOOD).read_text().replace("    sorted_token_ids.fill_(numel)\n", "")
    ctx = _candidate(project_repo, tmp_path, src, "no-fill")
    v = CorrectnessGuard().check(ctx)
    assert v.status is Status.FAIL
    assert "sorted_token_ids" in v.summary
    assert any("-7777" in str(e.value) or "poison" in str(e.value) or "sentinel" in str(e.value) for e in v.evidence)


@pytest.mark.slow
def test_crashing_child_is_fail_not_error(project_repo, tmp_path):
    ctx = _candidate(project_repo, tmp_path, HEADER + "import os\ndef moe_route_dispatch(*a, **k):\n    os._exit(3)\n", "exit")
    v = CorrectnessGuard().check(ctx)
    assert v.status is Status.FAIL
    assert "child exited with status 3" in v.summary


@pytest.mark.slow
def test_hanging_child_is_killed_and_fails(project_repo, tmp_path):
    ctx = _candidate(project_repo, tmp_path, HEADER + "import time\ndef moe_route_dispatch(*a, **k):\n    time.sleep(3600)\n", "hang")
    v = CorrectnessGuard().check(ctx)
    assert v.status is Status.FAIL
    assert "exceeded its 20 s limit" in v.summary
    assert next(e.value for e in v.evidence if e.name == "child_duration") < 60


@pytest.mark.slow
def test_scope_claims_beyond_the_task_fail_activation(project_repo, tmp_path):
    src = (project_repo / GOOD).read_text().replace("requests_max=64", "requests_max=128")
    ctx = _candidate(project_repo, tmp_path, src, "wide")
    corr = CorrectnessGuard().check(ctx)
    # rejected before any configuration runs (issue 17 item 6): correctness SKIPs, activation decides
    assert corr.status is Status.SKIP and corr.summary.startswith("Not run: the kernel's declared scope claims")
    assert ctx.artifacts.cases is None
    v = ActivationGuard().check(ctx)
    assert v.status is Status.FAIL
    assert "requests [1, 128] exceeds the task's [1, 64]" in v.summary


@pytest.mark.slow
def test_narrow_scope_passes_activation_and_records_fallbacks(project_repo, tmp_path):
    src = (project_repo / GOOD).read_text().replace("requests_max=64", "requests_max=8")
    ctx = _candidate(project_repo, tmp_path, src, "narrow")
    assert CorrectnessGuard().check(ctx).status is Status.PASS
    v = ActivationGuard().check(ctx)
    assert v.status is Status.PASS
    impl = {c["name"]: c["implementation"] for c in ctx.artifacts.cases}
    assert impl["k3_t8"] == "latency_specialized" and impl["k3_t16"] == "standard" and impl["k3_t64"] == "standard"


@pytest.mark.slow
def test_activation_logs_every_dispatch_decision_for_verbose_runs(project_repo, tmp_path, caplog):
    """``-v`` shows the dispatch decisions (a new user's finding: the children decide, and their logs stay in
    their pipes): the activation guard logs each configuration's decisions from the child's trace."""
    import logging

    src = (project_repo / GOOD).read_text().replace("requests_max=64", "requests_max=8")
    ctx = _candidate(project_repo, tmp_path, src, "narrow-logged")
    assert CorrectnessGuard().check(ctx).status is Status.PASS
    with caplog.at_level(logging.DEBUG, logger="guards.activation"):
        assert ActivationGuard().check(ctx).status is Status.PASS
    lines = {r.getMessage().split(":")[0]: r.getMessage() for r in caplog.records}
    assert "dispatch moe_dispatch -> latency_specialized (in scope" in lines["k3_t8"]
    assert ("dispatch moe_dispatch -> standard (out of declared scope: requests 16 outside [1, 8]; 16 rows, 16 requests, "
            "query length 1, phase decode)") in lines["k3_t16"]
    assert len({r.getMessage().split(":")[0] for r in caplog.records}) == len(ctx.artifacts.cases)


def test_scope_excess_lists_every_excess():
    task = load_task(Path(__file__).resolve().parents[2], "k3_moe_dispatch")
    out = scope_excess({"devices": ["cpu", "tpu"], "phases": ["decode", "prefill"], "tp_sizes": [1, 8],
                        "dtypes": ["float32"], "requests_min": 1, "requests_max": 64}, task.scope)
    assert out == ["devices ['tpu'] not in the task's ['cpu', 'cuda']",
                   "phases ['prefill'] not in the task's ['decode', 'spec_verify']", "tp_sizes [8] not in the task's [1]"]


def _plain_ctx() -> GuardContext:
    """A context for guards that look at nothing but ``ctx.artifacts``."""
    root = Path(__file__).resolve().parents[2]
    return GuardContext(task=load_task(root, "k3_moe_dispatch"), repo_root=root, worktree=root, base_commit="0" * 40,
                        candidate_commit="0" * 40, device="cpu", seed=1, judged_tree=root)  # no commit to clone


class _Boom:
    name = "boom"

    def check(self, ctx):
        raise KeyError("guard bug")


class _Pass:
    def __init__(self, name):
        self.name = name

    def check(self, ctx):
        return Verdict(guard=self.name, status=Status.PASS, summary="fine")


def test_guard_exception_is_error_and_stops_the_run():
    vs = run_guards(_plain_ctx(), [_Pass("isolation"), _Boom(), _Pass("activation")])
    assert [v.status for v in vs] == [Status.PASS, Status.ERROR, Status.SKIP]
    assert "KeyError" in vs[1].summary and vs[2].summary == "Not run: boom did not pass."
    assert not is_accepted(vs)
    assert is_accepted(run_guards(_plain_ctx(), [_Pass("isolation"), _Pass("activation")]))
    assert not is_accepted(run_guards(_plain_ctx(), [_Pass("isolation")]))  # no proof the path ran


def test_verdict_rules():
    with pytest.raises(ValueError, match="FAIL needs at least one evidence item"):
        Verdict(guard="x", status=Status.FAIL, summary="bad")
    v = Verdict(guard="x", status=Status.FAIL, summary="bad", evidence=(Evidence(name="n", value=1.5, unit="us"),))
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        v.summary = "other"  # type: ignore[misc]


def test_result_file_version_is_checked(tmp_path):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(WorkbenchError, match="schema_version 99; this workbench reads version 1"):
        read_result(p)
    p.write_text("{not json")
    with pytest.raises(WorkbenchError, match="not JSON"):
        read_result(p)


@pytest.mark.slow
def test_claiming_a_device_not_judged_fails_activation(project_repo, tmp_path):
    src = (project_repo / GOOD).read_text().replace('devices=("cpu",)', 'devices=("cpu", "cuda")')
    ctx = _candidate(project_repo, tmp_path, src, "both-devices")
    assert CorrectnessGuard().check(ctx).status is Status.SKIP  # rejected before any configuration ran
    v = ActivationGuard().check(ctx)
    assert v.status is Status.FAIL
    assert "devices ['cuda'] were not judged in this run (device cpu)" in v.summary


def _merge_good_kernel(repo: Path) -> None:
    import shutil

    from tests.conftest import git

    shutil.copy(repo / GOOD, repo / "k3_model/kernels/moe_dispatch/__init__.py")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "merge the good kernel", "--allow-empty")  # main may have it merged already


@pytest.mark.slow
def test_change_that_never_runs_on_top_of_a_merged_kernel_fails_activation(fresh_repo, tmp_path):
    _merge_good_kernel(fresh_repo)
    overlay = tmp_path / "dead-file"
    f = overlay / "k3_model/kernels/moe_dispatch/faster.py"
    f.parent.mkdir(parents=True)
    f.write_text((fresh_repo / GOOD).read_text())  # a kernel no package imports
    from workbench.pipeline import run_candidate

    result, _ = run_candidate(fresh_repo, "k3_moe_dispatch", str(overlay), device="cpu")
    v = result.first_failure()
    assert v is not None and v.guard == "activation"
    assert "None of the candidate's changed Python files ran" in v.summary
    assert "k3_model/kernels/moe_dispatch/faster.py" in v.evidence[0].value


@pytest.mark.slow
def test_notes_only_change_fails_activation(fresh_repo, tmp_path):
    _merge_good_kernel(fresh_repo)
    overlay = tmp_path / "notes"
    (overlay / "k3_model/kernels/moe_dispatch").mkdir(parents=True)
    (overlay / "k3_model/kernels/moe_dispatch/NOTES.md").write_text("faster now\n")
    from workbench.pipeline import run_candidate

    result, _ = run_candidate(fresh_repo, "k3_moe_dispatch", str(overlay), device="cpu")
    assert not result.accepted
    assert result.first_failure().summary.startswith("The candidate changes no Python source")


@pytest.mark.slow
def test_baseline_is_the_kernel_merged_at_the_base(fresh_repo, tmp_path):
    """Re-submitting the merged kernel (a whitespace change) gains nothing over the base: perf FAILs."""
    _merge_good_kernel(fresh_repo)
    overlay = tmp_path / "same"
    f = overlay / "k3_model/kernels/moe_dispatch/__init__.py"
    f.parent.mkdir(parents=True)
    f.write_text((fresh_repo / GOOD).read_text() + "\n# tuned\n")
    from workbench.pipeline import run_candidate

    result, _ = run_candidate(fresh_repo, "k3_moe_dispatch", str(overlay), device="cpu")
    v = result.first_failure()
    assert v is not None and v.guard == "perf", [x.one_line() for x in result.verdicts]
    assert {p.baseline_implementation for p in result.perf} == {"base kernel"}
    assert all(0.8 < p.speedup < 1.2 for p in result.perf)
    # the first workload without a gain decides: the later ones are not timed, and the verdict says so
    n = len(load_task(fresh_repo, "k3_moe_dispatch").perf.workloads) + PERF_RANDOM_DRAWS + PERF_DOMAIN_DRAWS
    assert len(result.perf) < n and "later configuration(s) not timed" in v.summary, v.summary
    assert [e.name for e in v.evidence].count("not_timed") == n - len(result.perf)


@pytest.mark.slow
def test_claiming_world_sizes_not_run_fails_activation(project_repo, tmp_path):
    """A kernel declaring TP 4 and 8 is rejected where only world sizes 1 and 2 were judged (as on a
    2-GPU machine); the same kernel passes where they all ran (tests/workbench/test_fixtures_e2e.py)."""
    src = project_repo / "tasks/k3_allreduce_rmsnorm/fixtures/good/oneshot-twoshot-cpu"
    c = create_candidate(project_repo, "k3_allreduce_rmsnorm", str(src))
    task = load_task(project_repo, "k3_allreduce_rmsnorm")
    small = tuple(w for w in task.correctness.workloads if w.axes["W"] <= 2)
    task = task.model_copy(update={"correctness": task.correctness.model_copy(
        update={"workloads": small, "random_draws": 0})})
    ctx = GuardContext(task=task, repo_root=project_repo, worktree=c.worktree, base_commit=c.base_commit,
                       candidate_commit=c.candidate_commit, device="cpu", seed=123)
    assert IsolationGuard().check(ctx).status is Status.PASS
    corr = CorrectnessGuard().check(ctx)
    assert corr.status is Status.SKIP, corr.summary  # no rank started a configuration
    assert "tp_sizes [4, 8] were not judged in this run" in corr.summary
    v = ActivationGuard().check(ctx)
    assert v.status is Status.FAIL
    assert "tp_sizes [4, 8] were not judged in this run" in v.summary


@pytest.mark.slow
def test_a_child_that_claims_an_early_scope_rejection_falsely_fails_correctness(project_repo, tmp_path, monkeypatch):
    """The early scope check runs in the child; the judge decides. A response that says "beyond the limits"
    for a scope inside them gets no shortcut: nothing ran, so correctness FAILs for every configuration."""
    import guards.correctness as correctness

    real = correctness.scope_limits
    monkeypatch.setattr(correctness, "scope_limits",
                        lambda task, device, tp: {**real(task, device, tp), "requests_max": 8})  # child sees 8
    ctx = _candidate(project_repo, tmp_path, (project_repo / GOOD).read_text() + "\n# a copy\n", "false-early")
    v = CorrectnessGuard().check(ctx)
    assert v.status is Status.FAIL and "no result" in " ".join(str(e.value) for e in v.evidence), v.summary


def test_inputs_unchanged_is_bitwise():
    """NaN over a zero, -0.0 over +0.0 and another NaN payload are changes; the old comparison through
    ``nan_to_num`` saw none of them (issue 12, "inputs-unchanged compared through nan_to_num")."""
    import torch

    from guards._protocol import tensor_digest
    from guards.correctness import _inputs_changed

    def sent(d):  # what the child sends back: digests of the inputs after the call
        return {k: tensor_digest(v) for k, v in d.items()}

    bias = torch.zeros(8)
    logits = torch.tensor([[1.0, float("nan"), -2.0, 0.5]])
    before = {"bias": bias, "logits": logits, "valid": torch.ones(1, dtype=torch.bool)}
    assert _inputs_changed(before, sent({k: v.clone() for k, v in before.items()})) == []  # NaN in place: unchanged

    nan_over_zero = bias.clone()
    nan_over_zero[3] = float("nan")
    neg_zero = bias.clone()
    neg_zero[5] = -0.0
    payload = logits.clone()
    payload.view(torch.int32)[0, 1] = 0x7FC00001  # still NaN, other bits
    assert torch.isnan(payload[0, 1])
    for name, after in (("bias", nan_over_zero), ("bias", neg_zero), ("logits", payload)):
        old = torch.equal(torch.nan_to_num(after), torch.nan_to_num(before[name]))
        assert old, "the old check passed this change"
        assert _inputs_changed(before, sent({**before, name: after})) == [name]
    half = torch.tensor([0.0, 1.0], dtype=torch.bfloat16)
    assert _inputs_changed({"x": half}, sent({"x": torch.tensor([-0.0, 1.0], dtype=torch.bfloat16)})) == ["x"]
    assert _inputs_changed({"x": half}, sent({"x": half.float()})) == ["x"]  # replaced by another dtype
    assert _inputs_changed({"x": half}, sent({"x": half.reshape(2, 1)})) == ["x"]  # another shape
    assert _inputs_changed({"x": half}, {}) == ["x"]  # not sent back
    assert _inputs_changed({"x": half}, {"x": half}) == ["x"]  # a tensor is not a digest: never trusted as one


def test_input_digest_memo_is_per_case_and_sees_in_place_changes():
    """An input's digest is computed once per tensor and memo (one case's calls), and again after an in-place
    change: an input changed between two calls' checks is never compared with its old digest."""
    import torch

    from guards import correctness
    from guards._protocol import tensor_digest

    memo: dict = {}
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    first = correctness.input_digest(x, memo)
    assert first == tensor_digest(x)
    assert correctness.input_digest(x, memo) is first  # memoised: the same dict, not hashed again
    x[1, 2] = -1.0  # in place: the version counter moves
    changed = correctness.input_digest(x, memo)
    assert changed == tensor_digest(x) and changed["sha256"] != first["sha256"]
    assert correctness._inputs_changed({"x": x}, {"x": first}, memo) == ["x"]
    assert correctness._inputs_changed({"x": x}, {"x": changed}, memo) == []
    y = x.clone()  # same bits, another object: its own entry, the same digest
    assert correctness.input_digest(y, memo) == changed and memo[id(y)][0] is y
    assert correctness.input_digest(x, {}) == changed  # another case's memo starts empty


def test_judge_heap_keeps_freed_blocks_for_reuse():
    """After :func:`workbench.heap.keep_freed_memory`, a freed 64 MiB tensor's pages are reused by the next one
    (a few page faults) instead of being mapped and faulted in again (one per 4 KiB page), and
    :func:`workbench.heap.give_back_freed_memory` returns them to the OS (the end of a judgment)."""
    import resource
    import subprocess
    import sys

    code = ("import resource, sys, torch\n"
            "from workbench.heap import keep_freed_memory\n"
            "ok = keep_freed_memory() if sys.argv[1] == 'keep' else None\n"
            "def twenty():\n"
            "    for _ in range(20):\n"
            "        t = torch.ones(16 << 20)\n"  # 64 MiB: 16384 pages of 4 KiB
            "        del t\n"
            "twenty()\n"  # the heap grows once (its first pages fault in either way)
            "r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "twenty()\n"
            "faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0\n"
            "from workbench.heap import give_back_freed_memory\n"
            "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * resource.getpagesize() >> 20\n"
            "held = rss()\n"
            "give_back_freed_memory()\n"
            "print(ok, faults, held - rss())\n")
    out = {}
    for mode in ("default", "keep"):
        p = subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        flag, faults, returned_mib = p.stdout.split()
        out[mode] = (flag, int(faults), int(returned_mib))
    if out["keep"][0] != "True":
        pytest.skip(f"no glibc mallopt here: {out}")
    pages = (64 << 20) // resource.getpagesize()  # of one tensor
    if out["default"][1] < 20 * pages // 2:  # transparent huge pages: few faults either way
        pytest.skip(f"the default allocator faults few pages here (huge pages?): {out}")
    assert out["keep"][1] < pages // 4, out  # the pages of the first round are reused
    assert out["keep"][2] >= 32, out  # give_back_freed_memory returns the kept 64 MiB block (MiB of RSS)


@pytest.mark.slow
def test_negative_zero_written_over_a_zero_input_fails_correctness(project_repo, tmp_path):
    """A kernel that flips the sign of the caller's zero bias (the ``ties`` workload's) is rejected
    although every output is right; bad fixture correctness-writes-nan-into-input writes NaN there."""
    src = (project_repo / GOOD).read_text() + (
        "    e_score_correction_bias.masked_fill_(e_score_correction_bias == 0, -0.0)\n")
    ctx = _candidate(project_repo, tmp_path, src, "neg-zero-bias")
    v = CorrectnessGuard().check(ctx)
    assert v.status is Status.FAIL, v.one_line()
    assert "edge_ties" in v.summary and "mutated input(s) e_score_correction_bias" in v.summary
# --- Scope is data, not code (issue 12 item 4) ---------------------------------------------------------

LYING_PHASES = '''
class _Phases(tuple):
    def __contains__(self, phase):
        return phase in ("decode", "prefill")
'''


@pytest.mark.slow
def test_activation_lying_scope_is_refused_by_the_child_dispatcher(project_repo, tmp_path):
    """A phases tuple that lists decode but contains prefill never reaches the activation check: the
    dispatcher refuses it when the kernel is imported, and correctness reports the ScopeError."""
    src = (project_repo / GOOD).read_text()
    src = src.replace('phases=("decode", "spec_verify")', 'phases=_Phases(("decode", "spec_verify"))')
    src = src.replace("\nSCOPE = ", LYING_PHASES + "\nSCOPE = ")
    ctx = _candidate(project_repo, tmp_path, src, "lying-phases")
    v = CorrectnessGuard().check(ctx)
    assert v.status is Status.FAIL
    assert ("ScopeError: k3_model.kernels.moe_dispatch (k3_model/kernels/moe_dispatch/): invalid SCOPE while "
            "importing the kernel: OpScope field 'phases' must be a plain tuple of str; got "
            "k3_model.kernels.moe_dispatch._Phases") in v.summary


def _activation_ctx(tmp_path: Path, scope) -> GuardContext:
    task = load_task(Path(__file__).resolve().parents[2], "k3_moe_dispatch")
    return GuardContext(task=task, repo_root=tmp_path, worktree=tmp_path, base_commit="b" * 40,
                        candidate_commit="c" * 40, device="cpu", seed=1,
                        artifacts=Artifacts(cases=[], case_objects=[], traces={}, scope=scope))


@pytest.mark.parametrize("scope, got", [
    ({"devices": ["cpu"], "phases": "decode", "tp_sizes": [1], "dtypes": ["float32"], "requests_min": 1,
      "requests_max": 64}, "OpScope field 'phases' must be a plain tuple of str; got str."),
    ({"devices": ["cpu"], "phases": ["decode"], "tp_sizes": [True], "dtypes": ["float32"], "requests_min": 1,
      "requests_max": 64}, "OpScope field 'tp_sizes' item 0 must be exactly int; got bool."),
    ({"devices": ["cpu"], "phases": ["decode"], "tp_sizes": [1], "dtypes": ["float32"], "requests_min": 1,
      "requests_max": 64.5}, "OpScope field 'requests_max' must be exactly int; got float."),
])
def test_activation_fails_a_reported_scope_that_is_not_plain_data(tmp_path, scope, got):
    v = ActivationGuard().check(_activation_ctx(tmp_path, scope))
    assert v.status is Status.FAIL
    assert v.summary.startswith("The declared scope is not plain data: the declared scope the correctness child "
                                f"reported: {got}")
    assert v.evidence[0].name == "declared_scope" and v.evidence[0].path == "k3_model/kernels/moe_dispatch/"


def test_activation_claims_uses_the_dispatchers_rule():
    """``claims`` (activation and perf) and ``OpScope.covers`` (dispatcher) agree on every configuration."""
    from guards.activation import claims
    from k3_model.dispatch import BatchInfo, OpScope

    scope = OpScope(devices=("cpu",), phases=("decode", "spec_verify"), tp_sizes=(1, 2), dtypes=("float32",),
                    requests_min=2, requests_max=33, query_len_max=8)
    reported = {k: list(v) if isinstance(v, tuple) else v for k, v in scope.to_dict().items()}
    n_in = 0
    for phase in ("decode", "spec_verify", "prefill", "mixed"):
        for requests in (1, 2, 33, 34, 64):
            for q in (1, 8, 9):
                for device in ("cpu", "cuda"):
                    for dtype in ("float32", "bfloat16"):
                        for tp in (1, 2, 4):
                            step = dict(phase=phase, requests=requests, query_len=q, device=device, dtype=dtype, tp=tp)
                            want = scope.covers(BatchInfo(phase, requests, q, requests, device, dtype, tp))[0]
                            assert claims(reported, **step) is want
                            assert claims(scope, **step) is want
                            n_in += want
    assert n_in == 16  # decode and spec_verify (covers checks the ranges; forward_context the phase), requests 2
    # and 33, query length 1 and 8, cpu, float32, TP 1 and 2


@pytest.mark.slow
def test_distributed_correctness_stops_after_the_first_failing_world_size(project_repo):
    """bf16 accumulation is exact at TP 2 and wrong from TP 4 on: TP 8's ranks are never started, and
    the verdict says which world sizes were not run."""
    from workbench.pipeline import judge_candidate

    task = load_task(project_repo, "k3_allreduce_rmsnorm")
    fx = project_repo / "tasks/k3_allreduce_rmsnorm/fixtures/bad/correctness-bf16-accumulation"
    cand = create_candidate(project_repo, task.task_id, str(fx))
    result, _ = judge_candidate(project_repo, task, cand, device="cpu", seed=5,
                                guards=[IsolationGuard(), CorrectnessGuard()])
    v = result.first_failure()
    assert v is not None and v.guard == "correctness", [x.one_line() for x in result.verdicts]
    assert {c.world_size for c in result.cases} == {1, 2, 4}
    assert all(c.passed for c in result.cases if c.world_size < 4)
    not_run = next(e for e in v.evidence if e.name == "not_run")
    assert not_run.path == "world sizes [8]: a smaller one failed" and not_run.value > 0


def test_files_for_other_devices_by_subpackage(tmp_path):
    from guards.activation import files_for_other_devices

    root = "k3_model/kernels/moe_dispatch"
    changed = [f"{root}/__init__.py", f"{root}/cuda/__init__.py", f"{root}/cuda/_triton_route.py", f"{root}/README.md",
               f"{root}/cpu/x.py", "k3_model/ops/other.py"]
    # no cuda/ subpackage in the worktree: the op's package serves cuda, other devices' subpackages do not
    assert files_for_other_devices("moe_dispatch", "cuda", tmp_path, changed) == [f"{root}/cpu/x.py"]
    (tmp_path / root / "cuda").mkdir(parents=True)
    (tmp_path / root / "cuda" / "__init__.py").write_text("")
    # with one, only cuda/ serves cuda: the op's own files and cpu/ are the other devices'
    assert files_for_other_devices("moe_dispatch", "cuda", tmp_path, changed) == [f"{root}/__init__.py",
                                                                                    f"{root}/cpu/x.py"]
    assert files_for_other_devices("moe_dispatch", "cpu", tmp_path, changed) == [f"{root}/cuda/__init__.py",
                                                                                   f"{root}/cuda/_triton_route.py"]


@pytest.mark.slow
def test_a_cuda_subpackage_judged_on_cpu_fails_activation(fresh_repo, tmp_path):
    """A run judges the kernel package that serves its device only: a CUDA subpackage judged on CPU is not
    judged at all (the CPU calls never reach it), so activation FAILs and names the file."""
    _merge_good_kernel(fresh_repo)
    overlay = tmp_path / "cuda-sub"
    f = overlay / "k3_model/kernels/moe_dispatch/cuda/__init__.py"
    f.parent.mkdir(parents=True)
    f.write_text(HEADER.replace('devices=("cpu",)', 'devices=("cuda",)')
                 + "def moe_route_dispatch(*a, **k):\n    raise NotImplementedError\n")
    from workbench.pipeline import run_candidate

    result, _ = run_candidate(fresh_repo, "k3_moe_dispatch", str(overlay), device="cpu")
    v = result.first_failure()
    assert v is not None and v.guard == "activation", [x.one_line() for x in result.verdicts]
    assert v.summary.startswith("The candidate changes 1 file(s) that serve other devices than cpu, the device of "
                                "this run (first: k3_model/kernels/moe_dispatch/cuda/__init__.py)")


def test_a_change_to_the_package_that_serves_other_devices_at_the_base_is_named(tmp_path):
    """A candidate judged on cuda that rewrites the op's package, which serves cpu at the base, would take
    the CPU kernel away unjudged: base_devices_changed names cpu (the activation guard FAILs on it)."""
    from guards.activation import base_devices_changed, base_scope_devices
    from tests.conftest import git

    pkg = tmp_path / "k3_model/kernels/moe_dispatch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(HEADER)
    git(tmp_path, "init", "-q", "-b", "main")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "base with a cpu kernel")
    base = git(tmp_path, "rev-parse", "HEAD")
    flat, sub = "k3_model/kernels/moe_dispatch/__init__.py", "k3_model/kernels/moe_dispatch/cuda/__init__.py"
    assert base_devices_changed("moe_dispatch", "cuda", tmp_path, base, [flat]) == ["cpu"]
    assert base_devices_changed("moe_dispatch", "cuda", tmp_path, base, [sub]) == []  # its own package
    assert base_devices_changed("moe_dispatch", "cpu", tmp_path, base, [flat]) == []  # judged where it serves
    assert base_devices_changed("dspark_verify", "cuda", tmp_path, base, ["k3_model/kernels/dspark_verify/x.py"]) == []
    assert base_scope_devices("SCOPE = build_scope()\n") is None  # not a literal: counts as every device
    (pkg / "__init__.py").write_text("SCOPE = build_scope()\n")
    git(tmp_path, "commit", "-qam", "a computed scope")
    assert base_devices_changed("moe_dispatch", "cuda", tmp_path, git(tmp_path, "rev-parse", "HEAD"),
                                [flat]) == ["unknown: SCOPE is not a literal"]
