"""The brief and the feedback: what they say (exact values), what they leave out, and where seeds show."""

from __future__ import annotations

import re

import pytest

from guards.verdict import Evidence, Status, Verdict
from workbench.agents.baseline import BaselineTimings, quantile, summarize
from workbench.agents.brief import (
    failure_cause,
    redact,
    render_brief,
    render_feedback,
    reproduce_command,
    workload_line,
)
from workbench.agents.command_backend import PLACEHOLDER_MEANINGS, PLACEHOLDERS
from workbench.agents.pricing import cost_usd, price_for
from workbench.envs import AGENT_VARIABLES
from workbench.results import CandidateInfo, CaseResult, PerfResult, RunResult
from workbench.taskspec import WorkloadSpec, load_task

SEED = 1234567891


@pytest.fixture
def task(repo):
    return load_task(repo, "k3_moe_dispatch")


def test_brief_contents(repo, task):
    text = render_brief(task, repo_root=repo, worktree=repo, base_commit="a" * 40, device="cpu",
                        baseline_us={"k3_t1": 212.04, "k3_t64": 850.5}, mode="shell")
    assert "`k3_model/kernels/moe_dispatch/**`" in text
    assert "`k3_model.ops.moe_dispatch:moe_route_dispatch`" in text
    assert "- `topk_ids` (output): shape (T, K) int32" in text
    assert ("token rows `T` of requests in [1, 64] at query length `Q` in [1, 8] (requests = ceil(`T` / query length); "
            "decode steps at query length 1, verification steps above") in text
    assert "- `k3_t1`: 212.0 us per call" in text and "- `k3_t64`: 850.5 us per call" in text
    assert "measured once before you started (spread not measured):" in text
    assert f"workbench check k3_moe_dispatch --base {'a' * 40}" in text
    assert "Never weaken a check" in text  # AGENTS.md
    assert "public seeds [0, 1, 2]" in text
    assert f"{task.correctness.random_draws} configurations drawn at judging time" in text
    tools = render_brief(task, repo_root=repo, worktree=repo, base_commit="a" * 40, device="cpu", baseline_us=None,
                         mode="tools")
    assert "`run_check` tool" in tools and "workbench check k3_moe_dispatch --base" not in tools
    assert "Baseline medians: not measured for this run." in tools


def test_brief_names_every_agent_variable_and_placeholder(repo, task):
    """Shell agents get every WORKBENCH_* variable and --agent-cmd placeholder by its exact name (issue 20:
    an agent guessed a wrong name for the feedback file); a tools agent, which has neither, gets its tools instead."""
    shell = render_brief(task, repo_root=repo, worktree=repo, base_commit="a" * 40, device="cpu", baseline_us=None,
                         mode="shell")
    assert len(AGENT_VARIABLES) == 8 and len(PLACEHOLDER_MEANINGS) == len(PLACEHOLDERS) == 9
    for name, meaning in AGENT_VARIABLES.items():
        assert f"- `{name}`: {meaning}\n" in shell
    for name in PLACEHOLDERS:
        assert f"- `{{{name}}}`: {PLACEHOLDER_MEANINGS[name]}\n" in shell
    assert ("- `WORKBENCH_FEEDBACK`: path of the previous attempt's feedback file (empty on the first attempt)"
            in shell)
    # the name an agent guessed (issue 20), spelled so the variable-table scan does not take it for a real one
    assert "WORKBENCH_" + "FEEDBACK_FILE" not in shell
    tools = render_brief(task, repo_root=repo, worktree=repo, base_commit="a" * 40, device="cpu", baseline_us=None,
                         mode="tools")
    assert "WORKBENCH_" not in tools and "{feedback_file}" not in tools
    assert "`list_files`, `read_file`, `write_file`" in tools and "`submit`" in tools


def test_brief_timing_method_for_the_judged_device_only(repo, task):
    cpu = render_brief(task, repo_root=repo, worktree=repo, base_commit="a" * 40, device="cpu", baseline_us=None,
                       mode="shell")
    assert "The clock is the **CPU time of your child process**, all its threads together" in cpu
    assert "CPU time spent *between* calls fails the run" in cpu and "allowance 5000 us + 2% of the in-call" in cpu
    assert "Waiting off-CPU inside a call (sleeping, blocking) fails the run" in cpu
    assert "max(50 us, 25% of the baseline median)" in cpu
    assert "- **Every** call's outputs are checked, warm-up included" in cpu
    assert "gets up to 2 extension rounds of 150 more calls per side" in cpu
    assert "20 warm-up and 150 timed calls per side" in cpu
    assert "slower than the baseline by more than 5 % (one-sided test at alpha 0.01)" in cpu
    assert "CUDA events" not in cpu and "synchronizes the whole device" not in cpu
    cuda = render_brief(task, repo_root=repo, worktree=repo, base_commit="a" * 40, device="cuda", baseline_us=None,
                        mode="shell")
    assert "The clock is the **judge's wall clock** per call; your process synchronizes the whole device" in cuda
    assert "CUDA events are a second opinion" in cuda and "physical floor" in cuda
    assert "slower than the baseline by more than 1.5 % (one-sided test at alpha 0.001)" in cuda  # [perf.cuda]
    assert "CPU time of your child process" not in cuda and "Waiting off-CPU" not in cuda


def test_brief_baseline_with_spread_and_method(repo, task):
    samples = [200.0 + i for i in range(40)]
    b = BaselineTimings(device="cpu", timer="thread CPU time in the child", seed=0, warmup=5, repetitions=20,
                        workloads={"k3_t1": summarize(samples)})
    text = render_brief(task, repo_root=repo, worktree=repo, base_commit="a" * 40, device="cpu", baseline_us=b,
                        mode="shell")
    # 40 samples 200..239: median 219.5, 10th percentile 203.9, 90th 235.1 (linear interpolation)
    assert "- `k3_t1`: 219.5 us per call (range 203.9-235.1 us, 14 % of the median; 40 samples)" in text
    assert ("median and 10th-90th percentile range of 20 timed calls on each of two standard-path sides after 5 "
            "warm-up calls, inputs from public seed 0, timer: thread CPU time in the child:") in text
    assert "These are rough" in text and "Only the paired ratio decides." in text
    assert "`k3_t64`: " not in text.split("## Baseline")[0].split("Baseline (standard path)")[-1]


def test_quantiles():
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.25) == pytest.approx(1.75)
    t = summarize([float(x) for x in range(1, 11)])
    assert (t.median_us, t.p10_us, t.p90_us, t.samples) == (5.5, 1.9, 9.1, 10)
    assert t.spread_pct == pytest.approx(100 * 7.2 / 5.5)
    with pytest.raises(ValueError, match="no samples"):
        quantile([], 0.5)


def test_brief_scope_rule_and_no_distributed_rules_for_a_single_process_task(repo, task):
    text = render_brief(task, repo_root=repo, worktree=repo, base_commit="a" * 40, device="cpu", baseline_us=None,
                        mode="shell")
    assert ("- Scope rule: `SCOPE` must claim exactly what is judged: devices: only `cpu` (the device this run "
            "judges); phases within ['decode', 'spec_verify']; dtypes within ['float32']; requests_min/requests_max "
            "within [1, 64]; query_len_min/query_len_max within [1, 8]; TP size 1 only (a single-process task).") in text
    assert ("The activation guard rejects a `SCOPE` that claims a device, request count, query length, dtype or phase "
            "that is not judged in this run") in text
    assert "Distributed tasks" not in text and "torch.distributed" not in text
    scope_line = next(ln for ln in text.splitlines() if ln.startswith("- Task scope:"))
    assert "TP" not in scope_line and "world size" not in text
    assert "Self-check before you finish" in text  # the other AGENTS.md bullets stay


def test_brief_of_a_distributed_task(repo):
    dist = load_task(repo, "k3_allreduce_rmsnorm")
    text = render_brief(dist, repo_root=repo, worktree=repo, base_commit="a" * 40, device="cpu",
                        baseline_us={"anything": 1.0}, mode="shell")
    assert "- Distributed tasks (`k3_allreduce_rmsnorm`): your op runs in one process per TP rank" in text
    assert "TP sizes [1, 2, 4, 8]" in text
    assert "TP sizes within [1, 2, 4, 8] and only the world sizes this run judges (one process per rank)" in text
    assert "device, request count, query length, dtype, phase or world size that is not judged" in text
    # its perf is judged on CUDA only: on CPU no timing method and no baseline
    assert "Performance is not judged on cpu for this task (it is on cuda)" in text
    assert "How the judge times" not in text and "Baseline" not in text


def test_workload_lines_have_no_empty_field(repo, task):
    """Issue 20: a workload without params printed "T=3; ; case ..."."""
    w = WorkloadSpec(name="w3", axes={"T": 3, "E": 896}, case="realistic")
    assert workload_line(w) == "- `w3`: T=3, E=896; case `realistic`"
    w = WorkloadSpec(name="w4", axes={"T": 4}, params={"renormalize": True}, note="odd")
    assert workload_line(w) == "- `w4`: T=4; renormalize=True; case `realistic` (odd)"
    for t in (task, load_task(repo, "k3_dspark_verify"), load_task(repo, "k3_allreduce_rmsnorm")):
        text = render_brief(t, repo_root=repo, worktree=repo, base_commit="a" * 40, device="cpu", baseline_us=None,
                            mode="shell")
        lines = [ln for ln in text.splitlines() if ln.startswith("- `") and "case `" in ln]
        assert len(lines) == len(t.correctness.workloads)
        assert not any(re.search(r":\s*;|;\s*;|;\s*$", ln) for ln in lines), lines


BASE, CAND = "b" * 40, "c" * 40
COMMAND = f"workbench verify k3_moe_dispatch --branch {CAND} --base {BASE[:12]} --device cpu --seed {SEED}"


def _result(seed: int, *, verdicts=None, cases=None, perf=(), command: str | None = None) -> RunResult:
    fail = Verdict(guard="correctness", status=Status.FAIL, summary="1 of 29 configurations wrong; first: random-3-k3_t8 (T=41).",
                   evidence=(Evidence(name="mismatch", value=f"[a_fresh] topk_ids differ (seed {seed})", path="random-3-k3_t8"),))
    return RunResult(
        result_id="r", task_id="k3_moe_dispatch", task_spec_sha256="0" * 64,
        candidate=CandidateInfo(source="wb/k3_moe_dispatch/1", kind="branch", branch="wb/k3_moe_dispatch/1",
                                worktree="/w", base_commit=BASE, candidate_commit=CAND,
                                changed_paths=("k3_model/kernels/moe_dispatch/__init__.py",)),
        environment={}, device="cpu",
        verdicts=verdicts or (Verdict(guard="isolation", status=Status.PASS, summary="ok."), fail,
                              Verdict(guard="activation", status=Status.SKIP, summary="Not run: correctness did not pass.")),
        accepted=False, seed=seed,
        cases=cases if cases is not None else (
            CaseResult(name="k3_t8", axes={"T": 8, "E": 896}, params={}, case="realistic",
                       implementation="latency_specialized", passed=True),
            CaseResult(name="random-3-k3_t8", axes={"T": 41, "E": 896}, params={}, case="realistic",
                       implementation="latency_specialized", passed=False, mismatches=("[a_fresh] topk_ids differ",))),
        perf=perf, command=command or COMMAND.replace(str(SEED), str(seed)), started_at="2026-01-01T00:00:00+00:00",
        duration_s=1.0)


def _block(text: str, guard: str) -> str:
    """The "What failed" block of one guard."""
    return text.split(f"### {guard}: ", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]


def test_feedback_on_a_wrong_output(task):
    """Item 4: guard, configuration, expected, seen, the reproduce command with its seed, the cause."""
    text = render_feedback(_result(SEED), attempt=1, attempts=3, task=task)
    assert text.startswith("# Feedback on attempt 1 of 3: REJECTED")
    assert f"Judged commit `{CAND[:12]}` on cpu with seed {SEED} (changed: " in text
    assert "- correctness: FAIL: 1 of 29 configurations wrong" in text
    block = _block(text, "correctness")
    assert block.startswith("FAIL\n- Guard: `correctness`: 1 of 29 configurations wrong")
    assert "- Cause: **candidate**: your kernel's outputs differ from the reference" in block
    assert ("- Configurations (1 of 2 judged fail): `random-3-k3_t8` (T=41, E=896; case realistic; ran "
            "latency_specialized)") in block
    assert "k3_t8` (T=8" not in block  # the passing configuration is not named
    assert ("- Expected: every output of every call (fresh, reused and repeated buffers) within tolerance of the "
            "reference (`topk_weights` rtol 1e-05, atol 1e-06; `topk_ids` exact;") in block
    assert "- Seen: `random-3-k3_t8`: [a_fresh] topk_ids differ\n" in block
    assert f"\n  {COMMAND}\n" in block  # the recorded reproduce command, seed included
    assert f"same seed {SEED}, same inputs" in block
    assert "- mismatch [random-3-k3_t8]: [a_fresh] topk_ids differ (seed 1234567891)" in text


def test_feedback_redacts_what_the_caller_hides():
    text = render_feedback(_result(SEED), attempt=1, attempts=3, hidden=[SEED])
    assert str(SEED) not in text
    assert "--seed <redacted>" in text and "(seed <redacted>)" in text


def test_reproduce_command_built_when_the_recorded_one_lacks_the_seed():
    r = _result(77, command="workbench run k3_moe_dispatch --candidate p.patch")
    assert reproduce_command(r) == f"workbench verify k3_moe_dispatch --branch {CAND} --base {BASE[:12]} --device cpu --seed 77"
    assert reproduce_command(_result(77)) == COMMAND.replace(str(SEED), "77")


def _perf(name: str, verdict: str, speedup: float, **kw) -> PerfResult:
    return PerfResult(name=name, axes={"T": 64, "E": 896}, implementation="latency_specialized", baseline_us=(1.0,),
                      candidate_us=(1.0,), baseline_median_us=850.0, candidate_median_us=850.0 / speedup,
                      speedup=speedup, speedup_ci=(speedup - 0.02, speedup + 0.02), p_slower=0.001, verdict=verdict,
                      timer="cpu_thread_time", **kw)


def test_feedback_on_a_regression(task):
    perf_fail = Verdict(guard="perf", status=Status.FAIL, summary="1 configuration(s) fail; first: k3_t64 is slower.",
                        evidence=(Evidence(name="speedup[k3_t64]", value=0.9, unit="x"),))
    r = _result(SEED, verdicts=(Verdict(guard="correctness", status=Status.PASS, summary="ok."), perf_fail), cases=(),
                perf=(_perf("k3_t1", "gain", 1.5), _perf("k3_t64", "regression", 0.9, extension_rounds=1)))
    block = _block(render_feedback(r, attempt=2, attempts=3, task=task), "perf")
    assert "- Cause: **candidate**: your kernel's timing" in block
    assert "- Configuration: `k3_t64` (T=64, E=896)\n" in block and "`k3_t1`" not in block
    assert ("- Expected: no configuration more than 5 % slower than the baseline; at least 1.05x with the 99% "
            "interval above 1 where `SCOPE` claims your path;") in block
    assert ("- Seen: `k3_t64` (T=64, E=896; ran latency_specialized): regression, 0.900x, CI [0.880, 0.920], "
            "baseline 850.0 us, yours 944.4 us (cpu_thread_time); 1 extension round(s)\n") in block


def test_feedback_names_the_environment_as_the_cause(task):
    timeout = Verdict(guard="correctness", status=Status.FAIL,
                      summary="The candidate's code did not complete: child exceeded its 300 s limit (wall clock) and was killed",
                      evidence=(Evidence(name="child_problem", value="child exceeded its 300 s limit (wall clock) and was killed"),
                                Evidence(name="child_duration", value=300.2, unit="s")))
    r = _result(SEED, verdicts=(timeout,), cases=())
    text = render_feedback(r, attempt=1, attempts=2, task=task)
    block = _block(text, "correctness")
    assert "- Cause: **environment**: child exceeded its 300 s limit (wall clock) and was killed: a child timeout" in block
    assert "- Configuration: not one configuration: the check covers the whole candidate" in block
    assert "- Seen:\n  - child_problem: child exceeded its 300 s limit" in block
    assert "Every failure above points at the environment" in text
    assert f"\n  {COMMAND}\n" in block


def test_failure_cause():
    def v(guard="perf", status=Status.FAIL, summary="x.", **ev):
        return Verdict(guard=guard, status=status, summary=summary,
                       evidence=tuple(Evidence(name=k, value=val) for k, val in ev.items()) or (Evidence(name="e", value=1),))

    assert failure_cause(v(status=Status.ERROR, evidence=()))[0] == "environment"
    assert failure_cause(v(machine_load=3.9))[0] == "environment"
    assert "machine_load = 3.9" in failure_cause(v(machine_load=3.9))[1]
    assert failure_cause(v(load_avg_1m=2.0))[0] == "environment"
    assert failure_cause(v(summary="Ratio out of bounds on a loaded machine."))[0] == "environment"
    assert failure_cause(v(child_problem="the child never started"))[0] == "environment"
    assert failure_cause(v(payload_bytes=10))[0] == "candidate"  # "payload" is no load signal
    assert failure_cause(v(child_problem="child killed by signal 11 (SIGSEGV)"))[0] == "candidate"
    assert failure_cause(v(guard="isolation", forbidden_path="tests/x.py")) == (
        "candidate", "your change touches what a candidate may not")


def test_feedback_has_one_block_per_failing_verdict(task):
    iso = Verdict(guard="isolation", status=Status.FAIL, summary="1 forbidden path.",
                  evidence=(Evidence(name="forbidden_path", value="outside allowed_paths", path="tests/test_x.py"),))
    aud = Verdict(guard="audit", status=Status.ERROR, summary="The audit crashed.", evidence=())
    text = render_feedback(_result(SEED, verdicts=(iso, aud), cases=()), attempt=1, attempts=1, task=task)
    assert text.count("\n### ") == 2
    b1, b2 = _block(text, "isolation"), _block(text, "audit")
    assert "- Configuration: `tests/test_x.py`" in b1 and "- Cause: **candidate**" in b1
    assert "- Seen: forbidden_path [tests/test_x.py]: outside allowed_paths" in b1
    assert b2.startswith("ERROR") and "- Cause: **environment**: the guard itself broke" in b2
    assert "- Seen: The audit crashed." in b2


def test_feedback_configurations_carry_their_axes(task):
    """Activation names a workload and its batch; the feedback adds the case's axes. Model eval names its run."""
    act = Verdict(guard="activation", status=Status.FAIL,
                  summary="1 configuration(s) ran the wrong implementation; first: k3_t8 (batch 8) expected "
                          "latency_specialized, ran standard.",
                  evidence=(Evidence(name="wrong_implementation", value="expected latency_specialized, ran standard",
                                     path="k3_t8 batch=8"),))
    cases = (CaseResult(name="k3_t8", axes={"T": 8, "E": 896}, params={}, case="realistic", implementation="standard",
                        passed=True),)
    block = _block(render_feedback(_result(SEED, verdicts=(act,), cases=cases), attempt=1, attempts=2, task=task),
                   "activation")
    assert "- Configuration: `k3_t8` (T=8, E=896; case realistic; ran standard)\n" in block
    assert "- Expected: a plain-data `SCOPE` within what this run judges" in block
    assert "- Seen: wrong_implementation [k3_t8 batch=8]: expected latency_specialized, ran standard\n" in block
    assert "- Cause: **candidate**: your kernel's declared scope or dispatch does not match what ran" in block
    me = Verdict(guard="model_eval", status=Status.FAIL, summary="Greedy tokens differ at token 69.",
                 evidence=(Evidence(name="first_mismatch", value=69, unit="token index", path="sequence 1"),
                           Evidence(name="batch", value=2, unit="sequences"),
                           Evidence(name="context_tokens", value=2048, unit="tokens"),
                           Evidence(name="generated_tokens", value=256, unit="tokens per sequence")))
    block = _block(render_feedback(_result(SEED, verdicts=(me,), cases=()), attempt=1, attempts=2), "model_eval")
    assert ("- Configuration: K3-mini decode: batch 2 sequences, a 2048-token context, 256 generated tokens per "
            "sequence\n") in block
    assert "  - first_mismatch [sequence 1]: 69 token index\n" in block


def test_redact_whole_tokens_only():
    assert redact("seed 42 and 142 and 42x and 4242", [42]) == "seed <redacted> and 142 and 42x and 4242"


def test_prices():
    assert price_for("claude-sonnet-4-5-20250929") == price_for("claude-sonnet-4-5")
    assert price_for("claude-opus-4-5").input_per_mtok == 5.0
    assert price_for("claude-opus-4-1-20250805").output_per_mtok == 75.0
    assert price_for("claude-opus-4-9") is None and price_for("gpt-x") is None
    assert cost_usd("claude-haiku-4-5", input_tokens=1_000_000, output_tokens=200_000,
                    cache_creation_input_tokens=400_000, cache_read_input_tokens=2_000_000) == pytest.approx(
        1.0 + 1.0 + 0.5 + 0.2)
    assert cost_usd("unknown-model", input_tokens=10, output_tokens=10) is None


def test_the_report_says_what_neutral_means_where_a_row_is_neutral():
    """helper-33 (session 27): a random draw at 2.865x read "neutral" with no word on what that means."""
    from workbench.report import render_markdown

    legend = "`neutral`: judged for regressions only"
    with_neutral = render_markdown(_result(SEED, perf=(_perf("k3_t64", "gain", 1.4), _perf("random-1-k3_t8", "neutral", 2.865))))
    assert "| random-1-k3_t8 | T=64 E=896 |" in with_neutral and legend in with_neutral
    assert legend not in render_markdown(_result(SEED, perf=(_perf("k3_t64", "gain", 1.4),)))
