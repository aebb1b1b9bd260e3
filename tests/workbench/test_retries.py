"""No luck by retrying (issue 20 item 3): the same candidate content judged again is pooled with its
earlier judgings: a found bug stays found, perf pairs add up."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from guards.base import GuardContext
from guards.isolation import IsolationGuard
from guards.verdict import Evidence, Status, Verdict
from workbench import retries
from workbench.pipeline import judge_candidate
from workbench.results import CandidateInfo, PerfResult, RunResult, read_result, write_result
from workbench.taskspec import load_task
from workbench.worktree import create_candidate

KERNEL = "k3_model/kernels/moe_dispatch/__init__.py"
GOOD = Path(__file__).resolve().parents[2] / "tasks/k3_moe_dispatch/fixtures/good/lean-torch-cpu" / KERNEL


def test_comments_whitespace_and_docstrings_do_not_make_new_content():
    a = b'"""Doc."""\nimport torch\n\ndef f(x):\n    """Say."""\n    return x + 1  # one\n'
    b = b'import torch\ndef f(x):\n\n    return x + 1\n# a comment\n'
    c = b'import torch\ndef f(x):\n    return x + 2\n'
    assert retries.normalized_content("k.py", a) == retries.normalized_content("k.py", b)
    assert retries.normalized_content("k.py", a) != retries.normalized_content("k.py", c)
    assert retries.normalized_content("notes.md", b"x") != retries.normalized_content("notes.md", b"x ")
    assert retries.normalized_content("k.py", None) == "deleted"
    assert retries.normalized_content("bad.py", b"def (").startswith("bytes:")  # not Python: its bytes count


def _overlay(tmp_path: Path, name: str, text: str) -> Path:
    f = tmp_path / name / KERNEL
    f.parent.mkdir(parents=True)
    f.write_text(text)
    return tmp_path / name


@pytest.mark.slow
def test_content_key_same_up_to_comments_and_differs_by_code_device_task_and_guards(project_repo, tmp_path):
    task = load_task(project_repo, "k3_moe_dispatch")
    src = GOOD.read_text() + "\nVARIANT = 1  # differs from the kernel merged on main\n"
    c1 = create_candidate(project_repo, "k3_moe_dispatch", str(_overlay(tmp_path, "a", src)))
    c2 = create_candidate(project_repo, "k3_moe_dispatch", str(_overlay(tmp_path, "b", src + "\n# tuned\n")))
    c3 = create_candidate(project_repo, "k3_moe_dispatch", str(_overlay(tmp_path, "c", src + "\nX = 1\n")))

    def key(c, device="cpu", t=task, guards=("isolation",)):
        return retries.content_key(c.worktree, t, c.base_commit, c.candidate_commit, device, guards)

    assert c1.candidate_commit != c2.candidate_commit and key(c1) == key(c2)
    assert key(c1) != key(c3)
    assert key(c1) != key(c1, device="cuda")
    assert key(c1) != key(c1, guards=("isolation", "audit"))
    looser = task.model_copy(update={"perf": task.perf.model_copy(update={"min_speedup": 1.01})})
    assert key(c1) != key(c1, t=looser)


class _Flaky:
    """A stand-in correctness guard: FAIL on its first judging, PASS after (a lucky draw)."""

    name = "correctness"
    calls = 0

    def check(self, ctx: GuardContext) -> Verdict:
        type(self).calls += 1
        if type(self).calls == 1:
            return Verdict(guard=self.name, status=Status.FAIL, summary="k3_t33: topk_ids differ from the reference.",
                           evidence=(Evidence(name="case", value="k3_t33"),))
        return Verdict(guard=self.name, status=Status.PASS, summary="All configurations match.")


class _Ran:
    name = "activation"

    def check(self, ctx: GuardContext) -> Verdict:
        return Verdict(guard=self.name, status=Status.PASS, summary="ran")


@pytest.mark.slow
def test_a_bug_found_once_stays_found_when_the_same_content_is_judged_again(project_repo, tmp_path):
    task = load_task(project_repo, "k3_moe_dispatch")
    src = GOOD.read_text() + "\nVARIANT = 1  # differs from the kernel merged on main\n"
    guards = [IsolationGuard(), _Flaky(), _Ran()]
    c1 = create_candidate(project_repo, "k3_moe_dispatch", str(_overlay(tmp_path, "a", src)))
    r1, p1 = judge_candidate(project_repo, task, c1, device="cpu", seed=7, guards=guards)
    assert not r1.accepted and r1.judging == 1 and r1.pooled_from == ()
    # the same kernel with a comment, resubmitted: the stand-in now passes, the pooled verdict does not
    c2 = create_candidate(project_repo, "k3_moe_dispatch", str(_overlay(tmp_path, "b", src + "# again\n")))
    r2, p2 = judge_candidate(project_repo, task, c2, device="cpu", seed=8, guards=guards)
    assert _Flaky.calls == 2
    assert not r2.accepted and r2.judging == 2 and r2.pooled_from == (r1.result_id,)
    v = r2.first_failure()
    assert v.guard == "correctness" and v.summary.startswith("This exact code was judged before (this is judging 2 of it)")
    assert r1.result_id in v.summary and "k3_t33" in v.summary
    assert [x.status for x in r2.verdicts] == [Status.PASS, Status.FAIL, Status.SKIP]
    assert read_result(p2).content_key == r1.content_key == read_result(p1).content_key
    from workbench.report import render_markdown

    assert f"- judging 2 of this exact code: pooled with {r1.result_id}" in render_markdown(r2)
    lines = (retries.ledger_path(Path(project_repo) / ".workbench")).read_text().splitlines()
    assert len(lines) == 2 and r2.result_id in lines[1]
    # other content is a first judging again
    c3 = create_candidate(project_repo, "k3_moe_dispatch", str(_overlay(tmp_path, "c", src + "\nY = 2\n")))
    r3, _ = judge_candidate(project_repo, task, c3, device="cpu", seed=9, guards=guards)
    assert r3.accepted and r3.judging == 1


def _result(tmp_path: Path, rid: str, rows: list[PerfResult], verdicts: tuple[Verdict, ...]) -> Path:
    cand = CandidateInfo(source="x", kind="folder", branch="wb/t/1", worktree="/w", base_commit="a" * 40,
                         candidate_commit="b" * 40)
    r = RunResult(result_id=rid, task_id="k3_moe_dispatch", task_spec_sha256="0" * 64, candidate=cand,
                  environment={}, device="cpu", verdicts=verdicts, accepted=False, seed=1, perf=tuple(rows),
                  command="workbench verify", started_at="2026-12-01T00:00:00+00:00", duration_s=1.0)
    return write_result(r, tmp_path)


def _pairs(n: int, ratio: float, noise: float, seed: int) -> tuple[list[float], list[float]]:
    rng = random.Random(seed)
    base = [100.0 * (1 + rng.uniform(-noise, noise)) for _ in range(n)]
    return base, [b / ratio * (1 + rng.uniform(-noise, noise)) for b in base]


def _row(name: str, base, cand, verdict: str) -> dict:
    return {"name": name, "axes": {"T": 64}, "implementation": "latency_specialized",
            "baseline_implementation": "standard", "baseline_us": tuple(base), "candidate_us": tuple(cand),
            "baseline_median_us": 100.0, "candidate_median_us": 90.0, "speedup": 1.1, "speedup_ci": (1.01, 1.2),
            "p_slower": 1.0, "verdict": verdict, "timer": "judge: child process CPU clock"}


def test_perf_is_judged_on_the_pooled_pairs_of_every_judging(project_repo, tmp_path):
    """Two judgings with no gain (1.0x) and one lucky one (1.12x): pooled, the gain is gone."""
    task = load_task(project_repo, "k3_moe_dispatch")
    perf_fail = Verdict(guard="perf", status=Status.FAIL, summary="no real gain",
                        evidence=(Evidence(name="speedup[k3_t64]", value=1.0, unit="x"),))
    earlier = []
    for i in range(2):
        b, c = _pairs(150, 1.0, 0.05, seed=i)
        row = PerfResult(**_row("k3_t64", b, c, "no_gain"))
        p = _result(tmp_path, f"k3_moe_dispatch-{i}-x", [row], (perf_fail,))
        earlier.append(retries.Judging(key="k", result_id=f"k3_moe_dispatch-{i}-x", result_path=str(p),
                                       accepted=False, failed_guard="perf"))
    b, c = _pairs(150, 1.12, 0.02, seed=5)
    now = [_row("k3_t64", b, c, "gain")]
    verdicts = [Verdict(guard="correctness", status=Status.PASS, summary="ok"),
                Verdict(guard="perf", status=Status.PASS, summary="Faster")]
    pooled = retries.pool(task, verdicts, now, earlier, device="cpu")
    assert pooled.judging == 3 and pooled.pooled_from == ["k3_moe_dispatch-0-x", "k3_moe_dispatch-1-x"]
    (row,) = pooled.perf
    assert len(row["candidate_us"]) == 450 and row["pooled_judgings"] == 3
    assert row["verdict"] == "no_gain" and row["speedup"] < task.perf.min_speedup, row["speedup"]
    pv = pooled.verdicts[1]
    assert pv.status is Status.FAIL and pv.summary.startswith("Pooled over 3 judgings")
    assert pooled.verdicts[0] == verdicts[0]
    # without earlier judgings nothing changes
    alone = retries.pool(task, verdicts, now, [], device="cpu")
    assert alone.verdicts == verdicts and alone.perf == now and alone.judging == 1


def test_windows_busy_between_their_calls_are_never_pooled_into_a_gain(project_repo, tmp_path):
    """Session 17's review: busy_outside rows relabelled with their timing verdict (no_gain) were pooled, and
    six judgings of one deferring kernel at a noisy 1.15x reached a gain. busy_outside is not timing-only:
    the pairs of such windows stay out of the pool, in this judging and in earlier ones."""
    task = load_task(project_repo, "k3_moe_dispatch")
    busy = Verdict(guard="perf", status=Status.FAIL, summary="busy between its calls",
                   evidence=(Evidence(name="speedup[k3_t64]", value=1.15, unit="x"),))
    earlier = []
    for i in range(5):
        b, c = _pairs(24, 1.15, 0.3, seed=10 + i)
        row = PerfResult(**{**_row("k3_t64", b, c, "busy_outside"), "candidate_outside_cpu_us": 50000.0})
        p = _result(tmp_path, f"k3_moe_dispatch-{i}-b", [row], (busy,))
        earlier.append(retries.Judging(key="k", result_id=f"k3_moe_dispatch-{i}-b", result_path=str(p),
                                       accepted=False, failed_guard="perf"))
    b, c = _pairs(24, 1.15, 0.3, seed=20)
    now = [{**_row("k3_t64", b, c, "busy_outside"), "candidate_outside_cpu_us": 50000.0}]
    verdicts = [Verdict(guard="correctness", status=Status.PASS, summary="ok"), busy]
    pooled = retries.pool(task, verdicts, now, earlier, device="cpu")
    assert pooled.verdicts[1].status is Status.FAIL and pooled.perf[0]["verdict"] == "busy_outside"
    assert len(pooled.perf[0]["candidate_us"]) == 24  # nothing pooled in
    # the same pairs labelled by their timings alone would pool: the premise of the attack
    relabelled = [{**now[0], "verdict": "no_gain"}]
    for j in earlier:
        r = json.loads(Path(j.result_path).read_text())
        r["perf"][0]["verdict"] = "no_gain"
        Path(j.result_path).write_text(json.dumps(r))
    assert len(retries.pool(task, verdicts, relabelled, earlier, device="cpu").perf[0]["candidate_us"]) == 144


def test_an_environment_failure_is_not_carried_over(project_repo, tmp_path):
    task = load_task(project_repo, "k3_moe_dispatch")
    timeout = Verdict(guard="correctness", status=Status.FAIL, summary="The child did not complete.",
                      evidence=(Evidence(name="child_problem", value="child exceeded its 60 s limit"),))
    p = _result(tmp_path, "k3_moe_dispatch-1-x", [], (timeout,))
    earlier = [retries.Judging(key="k", result_id="k3_moe_dispatch-1-x", result_path=str(p), accepted=False,
                               failed_guard="correctness")]
    verdicts = [Verdict(guard="correctness", status=Status.PASS, summary="ok"),
                Verdict(guard="activation", status=Status.PASS, summary="ran")]
    pooled = retries.pool(task, verdicts, [], earlier, device="cpu")
    assert pooled.verdicts == verdicts and pooled.judging == 2


def test_ledger_skips_a_partial_line(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_JUDGINGS", str(tmp_path / "l.jsonl"))
    j = retries.Judging(key="k", result_id="r1", result_path="/p", accepted=True, failed_guard="")
    retries.record_judging(tmp_path, j)
    with open(tmp_path / "l.jsonl", "a") as f:
        f.write('{"key": "k", "result_')
    assert retries.earlier_judgings(tmp_path, "k") == [j]
    assert retries.earlier_judgings(tmp_path, "other") == []


def test_a_judging_that_fails_again_leads_with_its_own_finding(project_repo, tmp_path):
    """A new user's finding: a rerun's summary quoted the earlier judging's failure (other experts, another
    seed) while this run's own table showed its own; now this judging's failure leads, the earlier one named."""
    task = load_task(project_repo, "k3_moe_dispatch")
    old = Verdict(guard="correctness", status=Status.FAIL, summary="k3_t33: missing experts [847], extra [848].",
                  evidence=(Evidence(name="first_mismatch", value="k3_t33"),))
    p = _result(tmp_path, "k3_moe_dispatch-1-x", [], (old,))
    earlier = [retries.Judging(key="k", result_id="k3_moe_dispatch-1-x", result_path=str(p), accepted=False,
                               failed_guard="correctness")]
    verdicts = [Verdict(guard="correctness", status=Status.FAIL, summary="k3_t33: missing experts [559], extra [560].",
                        evidence=(Evidence(name="first_mismatch", value="k3_t33"),)),
                Verdict(guard="activation", status=Status.SKIP, summary="Not run: correctness did not pass.")]
    pooled = retries.pool(task, verdicts, [], earlier, device="cpu")
    v = pooled.verdicts[0]
    assert v.status is Status.FAIL and v.summary.startswith(
        "k3_t33: missing experts [559], extra [560]. (This exact code was judged before, this is judging 2 ")
    assert "judging k3_moe_dispatch-1-x (seed 1) found it wrong too, at correctness.)" in v.summary
    assert {e.name: e.value for e in v.evidence}["earlier_result"] == "k3_moe_dispatch-1-x"
    assert [x.status for x in pooled.verdicts] == [Status.FAIL, Status.SKIP]
