"""The CLI's contract: exit 0 accepted / 1 rejected / 2 bad input / 3 correct but perf not judged; the last
line is the result path; every result records its seed and its reproduce command names it."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CPU_GAIN_JUDGINGS, SUITE_MODEL_EVAL, gain_unconfirmed

GOOD = "tasks/k3_moe_dispatch/fixtures/good/lean-torch-cpu"
BAD = "tasks/k3_moe_dispatch/fixtures/bad/correctness-mutates-input.inject.toml"


def wb(repo: Path, *args: str, suite_model_eval: bool = False) -> subprocess.CompletedProcess:
    # no WORKBENCH_* setting of the test process leaks in, but the test's own judgings ledger (conftest) and,
    # for a judgment that reaches the model eval (suite_model_eval), the suite's model-eval lengths
    # (SUITE_MODEL_EVAL): these tests are about the CLI's contract (exit codes, printed lines, the recorded
    # seed, the fixture base); the model eval at its default lengths and both dtypes is judged by its own
    # tests (tests/guards/test_model_eval.py) and the exploit corpus. (A run records
    # such settings in its reproduce command, so the tests of that command run without them.)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKBENCH_") or k == "WORKBENCH_JUDGINGS"}
    if suite_model_eval:
        env.update(SUITE_MODEL_EVAL)
    return subprocess.run([sys.executable, "-m", "workbench", *args], cwd=repo, capture_output=True, text=True,
                          env=env, timeout=600)


def _gain_unconfirmed(p: subprocess.CompletedProcess) -> bool:
    """Whether the result a `workbench run` printed last failed at perf on a gain not confirmed (``gain_unconfirmed``)."""
    from workbench.results import read_result

    return gain_unconfirmed(read_result(Path(p.stdout.strip().splitlines()[-1])).first_failure())


@pytest.mark.slow
@pytest.mark.quiet(whole=True)  # the accept rests on a CPU perf gain, timed in a subprocess
def test_run_accepts_good_and_prints_result_path_last(project_repo):
    p = wb(project_repo, "run", "k3_moe_dispatch", "--candidate", GOOD, "--device", "cpu", suite_model_eval=True)
    judging = 1
    while p.returncode == 1 and _gain_unconfirmed(p) and judging < CPU_GAIN_JUDGINGS:
        # a CPU gain that one timing on a noisy 2-core machine did not confirm (session 25's landing CI: mini_t1
        # 1.236x with the interval down to 0.993): judged again, pooled with the earlier judgings
        # (workbench/retries.py), as a user re-runs; a real regression stays one
        p = wb(project_repo, "run", "k3_moe_dispatch", "--candidate", GOOD, "--device", "cpu", suite_model_eval=True)
        judging += 1
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.splitlines()[0] == f"k3_moe_dispatch candidate {GOOD}: ACCEPTED"
    last = Path(p.stdout.strip().splitlines()[-1])
    assert last.suffix == ".json" and last.is_file()
    data = json.loads(last.read_text())
    assert data["accepted"] is True and data["perf_judged"] is True and data["schema_version"] == 2
    assert type(data["seed"]) is int and data["command"].endswith(f" --seed {data['seed']}")  # drawn, recorded
    assert data["judging"] == judging
    r = wb(project_repo, "report", str(last))
    assert r.returncode == 0 and "| perf | PASS |" in r.stdout
    assert r.stdout.startswith("# k3_moe_dispatch: ACCEPTED\n") and f"- seed: {data['seed']}\n" in r.stdout


@pytest.mark.slow
def test_run_rejects_bad_with_exit_1_showing_progress_and_verbose_after_the_subcommand(project_repo):
    p = wb(project_repo, "run", "k3_moe_dispatch", "--candidate", BAD, "--device", "cpu", "-v")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "correctness  FAIL" in p.stdout and "mutated input(s) router_logits" in p.stdout
    assert Path(p.stdout.strip().splitlines()[-1]).is_file()
    # progress (piped: plain lines on stderr): the phase, then each finished guard with its time
    err = p.stderr.splitlines()
    assert any(ln.startswith("[3/6 correctness] ") and "configurations in one child" in ln and " elapsed" in ln
               for ln in err), p.stderr
    finished = [ln.split()[:2] for ln in err if ln.startswith("  ") and ln.split()[1:2] in (["PASS"], ["FAIL"])]
    assert finished == [["isolation", "PASS"], ["audit", "PASS"], ["correctness", "FAIL"]], p.stderr
    # -v after the subcommand: the guard steps are logged
    assert "workbench.progress: guard correctness (3/6) started" in p.stderr, p.stderr


@pytest.mark.parametrize("args", [["tasks", "-v"], ["review", "list", "--verbose"], ["-v", "tasks"]])
def test_verbose_after_any_subcommand(project_repo, args):
    """`-v` may follow any subcommand, as --help says (helper-22, session 21: `tasks -v` and `review list -v`
    were "No such option")."""
    p = wb(project_repo, *args)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "No such option" not in p.stderr


def test_verbose_logs_the_childrens_dispatch_decisions(caplog):
    """`-v` logs the dispatch decisions the guards' children recorded (the result's dispatch_trace), counted."""
    import logging

    from workbench.pipeline import _log_dispatch

    d = {"op": "moe_dispatch", "implementation": "latency_specialized", "phase": "decode", "reason": "in scope"}
    trace = [d, d, {**d, "implementation": "standard", "reason": "batch 65 outside [1, 64]"}]
    with caplog.at_level(logging.DEBUG, logger="workbench.pipeline"):
        _log_dispatch(trace)
    assert [r.getMessage() for r in caplog.records] == [
        "dispatch: moe_dispatch -> latency_specialized x2 (phase decode): in scope",
        "dispatch: moe_dispatch -> standard x1 (phase decode): batch 65 outside [1, 64]"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="workbench.pipeline"):
        _log_dispatch(trace)
    assert caplog.records == []


@pytest.mark.parametrize("args, message", [
    (["run", "no_such_task", "--candidate", GOOD],
     "known tasks: k3_allreduce_rmsnorm, k3_dspark_verify, k3_kda_decode, k3_lse_merge, k3_moe_dispatch, "
     "k3_small_m_gemm"),
    (["run", "k3_moe_dispatch", "--candidate", "missing.patch"], "not a patch file, not a folder"),
    (["run", "k3_moe_dispatch", "--candidate", GOOD, "--device", "tpu"], "--device 'tpu': expected cpu, cuda or auto"),
    (["report", "nope.json"], "does not exist"),
    (["run", "k3_moe_dispatch", "--candidate", GOOD, "--seed", "-5"], "greater than or equal to 0"),
    (["run", "k3_moe_dispatch", "--candidate", GOOD, "--seed", "99999999999999999999"], "less than or equal to 2147483647"),
])
def test_bad_input_exits_2_with_one_clear_line(project_repo, args, message):
    p = wb(project_repo, *args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert message in p.stderr.replace("\n", " ")
    assert "Traceback" not in p.stderr


def test_outside_a_git_repo_is_a_clear_error(tmp_path):
    p = wb(tmp_path, "tasks")
    assert p.returncode == 2
    assert "is not inside a git repository" in p.stderr and "Traceback" not in p.stderr


def test_help_does_not_import_torch():
    code = "import sys; import workbench.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def test_git_repo_that_is_not_a_workbench_checkout(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("x")
    subprocess.run(["git", "-C", str(tmp_path), "add", "f"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x"], check=True)
    p = wb(tmp_path, "tasks")
    assert p.returncode == 2 and "not a kernel-workbench checkout" in p.stderr


@pytest.mark.slow
def test_selftest_judges_a_merged_fixture_on_a_fixture_base(fresh_repo):
    """The good fixture is merged at the base (as on main): selftest judges a fixture against the standard
    path on a fixture base that sets the merged kernel aside, and says so.

    The fixture judged here is a bad one the audit rejects (seconds, in parallel with other tests): that
    the merged good fixture itself is accepted on such a base is judged by tests/workbench/test_fixtures_e2e.py
    (main has it merged), and that a fixture-base result is never queued by tests/review/test_review_unjudged.py;
    judging it here through the CLI took 183 s with the machine to itself (its perf gain)."""
    import shutil

    from tests.conftest import git

    src = fresh_repo / GOOD / "k3_model/kernels/moe_dispatch/__init__.py"
    shutil.copy(src, fresh_repo / "k3_model/kernels/moe_dispatch/__init__.py")
    git(fresh_repo, "add", "-A")
    git(fresh_repo, "commit", "-qm", "merge the good kernel", "--allow-empty")  # main may have it already
    head = git(fresh_repo, "rev-parse", "HEAD")
    p = wb(fresh_repo, "selftest", "k3_moe_dispatch", "-f", "audit-caches-by-id")
    assert p.returncode == 0, p.stdout + p.stderr
    out = " ".join(p.stdout.split())
    assert f"baseline: the moe_dispatch kernel merged at {head[:10]}" in out
    assert "this fixture is judged against the standard path, on fixture base" in out
    assert "1 as expected" in out


def test_tables_are_not_truncated_when_piped(project_repo):
    p = wb(project_repo, "tasks")
    assert "k3_model/kernels/moe_dispatch/**" in p.stdout and "k3_model.ops.moe_dispatch:moe_route_dispatch" in p.stdout


@pytest.mark.slow
def test_run_without_seed_records_the_drawn_seed_and_its_command_reproduces_it(project_repo):
    p = wb(project_repo, "run", "k3_moe_dispatch", "--candidate", BAD, "--device", "cpu")
    assert p.returncode == 1, p.stdout + p.stderr
    first = json.loads(Path(p.stdout.strip().splitlines()[-1]).read_text())
    seed = first["seed"]
    assert type(seed) is int and seed not in (0, 1, 2)  # a run-time seed, never a public one
    argv = shlex.split(first["command"])
    assert argv[:2] == ["workbench", "run"] and argv[argv.index("--seed") + 1] == str(seed)
    q = wb(project_repo, *argv[1:])  # the reproduce command as recorded
    assert q.returncode == 1, q.stdout + q.stderr
    again = json.loads(Path(q.stdout.strip().splitlines()[-1]).read_text())
    assert again["seed"] == seed and again["command"] == first["command"]
    assert [c["axes"] for c in again["cases"]] == [c["axes"] for c in first["cases"]]  # the same random draws
    # the same content judged again is pooled with the first judging (workbench/retries.py): the same
    # failure, now also carried from the first result
    assert (first["judging"], again["judging"]) == (1, 2) and again["pooled_from"] == [first["result_id"]]
    carried = again["verdicts"][2]["summary"]  # this judging's own finding first, the earlier one named
    assert carried.startswith(first["verdicts"][2]["summary"].rstrip(".")) and carried.endswith(
        f"(This exact code was judged before, this is judging 2 of it; judging {first['result_id']} (seed {seed}) "
        "found it wrong too, at correctness.)")


def _perf_not_judged_result(tmp_path: Path):
    """A result as k3_allreduce_rmsnorm's good CPU fixture gets on CPU: everything passes, perf SKIPs."""
    from guards.verdict import Evidence, Status, Verdict
    from workbench.results import CandidateInfo, RunResult, perf_was_judged, write_result

    verdicts = tuple(Verdict(guard=g, status=Status.PASS, summary="ok.") for g in ("isolation", "audit", "correctness",
                                                                                     "activation"))
    verdicts += (Verdict(guard="model_eval", status=Status.SKIP, summary="K3-mini never calls op 'allreduce_rmsnorm'."),
                 Verdict(guard="perf", status=Status.SKIP,
                         summary="Performance of this task is judged on cuda only, not cpu: a CPU verdict would be a coin toss.",
                         evidence=(Evidence(name="perf_devices", value="cuda"),)))
    r = RunResult(
        result_id="k3_allreduce_rmsnorm-9-deadbeef", task_id="k3_allreduce_rmsnorm", task_spec_sha256="0" * 64,
        candidate=CandidateInfo(source="x", kind="folder", branch="wb/k3_allreduce_rmsnorm/9", worktree="/w",
                                base_commit="b" * 40, candidate_commit="c" * 40),
        environment={}, device="cpu", verdicts=verdicts, accepted=True, perf_judged=perf_was_judged(verdicts), seed=4242,
        command="workbench run k3_allreduce_rmsnorm --candidate x --base bbbbbbbbbbbb --device cpu --seed 4242",
        started_at="2026-01-01T00:00:00+00:00", duration_s=1.0)
    return r, write_result(r, tmp_path / "results")


def test_perf_not_judged_is_never_a_plain_accept(project_repo, tmp_path, monkeypatch):
    """Accepted with perf SKIPped: labelled everywhere, exit 3, queued as "accepted, not judged" (issue 15
    item 4: approving it needs --accept-unjudged; it used to stay out of the queue)."""
    from typer.testing import CliRunner

    import workbench.pipeline as pipeline
    from workbench.cli import app
    from workbench.review.store import ReviewStore

    result, path = _perf_not_judged_result(tmp_path)
    assert result.accepted and not result.perf_judged and result.acceptance == "correct_perf_not_judged"
    monkeypatch.setattr(pipeline, "run_candidate", lambda *a, **k: (result, path))
    db = f"sqlite:///{tmp_path / 'queue.db'}"
    out = CliRunner().invoke(app, ["run", "k3_allreduce_rmsnorm", "-c", "x", "--repo", str(project_repo)],
                             env={"WORKBENCH_DB": db, "COLUMNS": "250"})
    assert out.exit_code == 3, out.output
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "k3_allreduce_rmsnorm candidate x: CORRECT, PERF NOT JUDGED"
    assert lines[-1] == str(path)
    assert ("Perf was NOT judged on cpu (the task times it on cuda only): correctness and activation passed, but "
            "this result measures no speedup and claims none") in out.stdout
    assert ('review queue: queued as #1, accepted, not judged: model_eval, perf: approving it needs '
            '--accept-unjudged "REASON" (workbench review show 1)') in out.stderr
    assert [(it.result_id, it.state) for it in ReviewStore(db).items()] == [(result.result_id, "queued")]
    md = path.with_suffix(".md").read_text()
    assert md.startswith("# k3_allreduce_rmsnorm: CORRECT, PERF NOT JUDGED\n\n> **Perf was NOT judged on cpu")
    assert "`workbench verify k3_allreduce_rmsnorm --branch wb/k3_allreduce_rmsnorm/9 --device cuda`" in md
    assert "- seed: 4242\n" in md


def test_schema_1_result_files_are_upgraded_on_read(tmp_path):
    """Old result files stay readable (the review queue points at them): seed from the command, perf_judged
    from the perf verdict."""
    from workbench.results import read_result

    result, path = _perf_not_judged_result(tmp_path)
    old = json.loads(path.read_text())
    for k in ("seed", "perf_judged"):
        del old[k]
    old["schema_version"] = 1
    v1 = tmp_path / "v1.json"
    v1.write_text(json.dumps(old))
    r = read_result(v1)
    assert (r.schema_version, r.seed, r.perf_judged, r.acceptance) == (2, 4242, False, "correct_perf_not_judged")
    old["command"] = "workbench run k3_allreduce_rmsnorm --candidate x --device cpu"  # v1 without --seed
    old["verdicts"][-1] = {"guard": "perf", "status": "PASS", "summary": "Faster.", "evidence": [], "duration_s": 0.0}
    v1.write_text(json.dumps(old))
    r = read_result(v1)
    assert (r.seed, r.perf_judged, r.acceptance) == (None, True, "accepted")
    assert json.loads(v1.read_text())["schema_version"] == 1  # the file itself is never rewritten


def test_perf_judged_needs_a_perf_verdict_that_is_not_skip(tmp_path):
    import pydantic

    from workbench.results import RunResult

    result, _ = _perf_not_judged_result(tmp_path)
    data = json.loads(result.model_dump_json())
    data["perf_judged"] = True  # but perf SKIPped
    with pytest.raises(pydantic.ValidationError, match="perf_judged is true but the perf guard has no verdict other than SKIP"):
        RunResult.model_validate(data)


def test_tasks_shows_a_broken_task_toml_whole_and_exits_2(tmp_path):
    """Issue 17 item 6.1: the whole error (not cut at 80 characters), the valid tasks still listed, exit 2."""
    import shutil

    from typer.testing import CliRunner

    from tests.conftest import REPO_ROOT, git
    from workbench.cli import app

    repo = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "tasks/k3_moe_dispatch", repo / "tasks/k3_moe_dispatch", symlinks=True,
                    ignore=shutil.ignore_patterns("fixtures", "__pycache__"))
    shutil.copytree(REPO_ROOT / "k3_model", repo / "k3_model", ignore=shutil.ignore_patterns("__pycache__"))
    broken = repo / "tasks/broken_task/task.toml"
    broken.parent.mkdir()
    broken.write_text("op = \n")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    out = CliRunner().invoke(app, ["tasks", "--repo", str(repo)], env={"COLUMNS": "250"})
    assert out.exit_code == 2, out.output
    assert "k3_model/kernels/moe_dispatch/**" in out.stdout  # the valid task is still listed
    assert "broken_task" in out.stdout and "invalid" in out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: Task 'broken_task' (")
    assert lines[0].endswith("Fix the syntax.") and len(lines[0]) > 80  # the whole message, fix included


def test_verdict_text_in_square_brackets_is_printed_whole(monkeypatch, tmp_path):
    """Issue 20: the console dropped "[cuda_event ...]" from a perf reason (rich took it for a tag)."""
    import io

    from rich.console import Console

    from guards.verdict import Evidence, Status, Verdict
    from workbench import cli
    from workbench.results import CandidateInfo, RunResult

    summary = ("1 configuration(s) fail; first: k3_t1 is timed untrustworthily [cuda_event (CUDA events longer than "
               "the judge's window: timer tampering)]: 1.100x (CI 0.968-1.193).")
    result = RunResult(
        result_id="r", task_id="k3_moe_dispatch", task_spec_sha256="0" * 64,
        candidate=CandidateInfo(source="[red]wb/x[/red]", kind="branch", branch="wb/x", worktree="/w",
                                base_commit="b" * 40, candidate_commit="c" * 40),
        environment={}, device="cuda", verdicts=(Verdict(guard="perf", status=Status.FAIL, summary=summary,
                                                         evidence=(Evidence(name="e", value=1),)),),
        accepted=False, seed=1, command="workbench verify k3_moe_dispatch --branch x --seed 1",
        started_at="2026-01-01T00:00:00+00:00", duration_s=1.0)
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=400, highlight=False, soft_wrap=True))
    cli._print_result(result, tmp_path / "[bold]r.json")
    text = out.getvalue()
    assert "k3_moe_dispatch candidate [red]wb/x[/red]: REJECTED\n" in text
    assert f"  perf         FAIL  {summary}\n" in text
    assert text.endswith(f"{tmp_path}/[bold]r.json\n")
    err = io.StringIO()
    monkeypatch.setattr(cli, "err", Console(file=err, width=400, highlight=False, soft_wrap=True))
    with pytest.raises(cli.typer.Exit):
        cli._fail(ValueError("--device [gpu]: expected cpu, cuda or auto."))
    assert err.getvalue() == "error: --device [gpu]: expected cpu, cuda or auto.\n"


def test_command_help_has_no_rest_markup():
    """`--help` prints a command's docstring as it is: no reST ``literals`` (helper-22, session 21: `agent --help`)."""
    import inspect

    from workbench.cli import app, pool_app
    from workbench.review.cli import review_app

    marked = [c.callback.__name__ for a in (app, review_app, pool_app) for c in a.registered_commands
              if "``" in (inspect.getdoc(c.callback) or "")]
    assert marked == []


def test_compare_shows_guards_side_by_side_and_no_empty_perf_table(tmp_path, monkeypatch):
    """``workbench compare`` of two results rejected before perf names each guard's status and says there are no
    perf rows (helper-33, session 27: it printed an empty table); with perf rows, configurations of either
    result are listed, a missing side as "-"."""
    import io

    from rich.console import Console

    from guards.verdict import Evidence, Status, Verdict
    from workbench import cli
    from workbench.results import CandidateInfo, PerfResult, RunResult, write_result

    def result(rid, verdicts, perf=(), key=""):
        r = RunResult(content_key=key, result_id=rid, task_id="k3_moe_dispatch", task_spec_sha256="0" * 64,
                      candidate=CandidateInfo(source="x", kind="folder", branch="wb/t/1", worktree="/w",
                                              base_commit="a" * 40, candidate_commit="b" * 40),
                      environment={}, device="cpu", verdicts=verdicts, accepted=False, seed=1, perf=tuple(perf),
                      command="workbench verify", started_at="2026-12-01T00:00:00+00:00", duration_s=1.0)
        return write_result(r, tmp_path / rid)

    ev = (Evidence(name="e", value=1),)
    wrong = (Verdict(guard="isolation", status=Status.PASS, summary="inside", evidence=ev),
             Verdict(guard="correctness", status=Status.FAIL, summary="k3_t8 differs from the reference", evidence=ev))
    outside = (Verdict(guard="isolation", status=Status.FAIL, summary="edits tests/", evidence=ev),
               Verdict(guard="correctness", status=Status.SKIP, summary="skipped", evidence=ev))
    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=300, highlight=False))
    cli.compare(result("a-1", wrong), result("b-2", outside))
    text = out.getvalue()
    assert "No perf rows in either result" in text and "configuration by configuration" not in text
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]] for line in text.splitlines()
            if line.startswith("│")}
    assert rows["isolation"] == ["PASS", "FAIL"] and rows["correctness"] == ["FAIL", "SKIP"]
    assert "k3_t8 differs from the reference" in text
    assert "Whether A and B judged the same code is not recorded in both results" in text
    assert "neutral: listed or drawn" not in text  # the perf legend only under a perf table

    def row(name, speedup, verdict):
        return PerfResult(name=name, axes={"T": 1}, implementation="latency_specialized", baseline_us=(1.0,),
                          candidate_us=(1.0,), baseline_median_us=1.0, candidate_median_us=1.0, speedup=speedup,
                          speedup_ci=(speedup, speedup), p_slower=0.5, verdict=verdict, timer="t")

    perf = (Verdict(guard="perf", status=Status.FAIL, summary="slower", evidence=ev),)
    out.truncate(0)
    out.seek(0)
    cli.compare(result("c-3", perf, [row("k3_t1", 1.2, "gain"), row("k3_t8", 0.8, "regression")], key="k1"),
                result("d-4", perf, [row("k3_t1", 1.1, "gain"), row("k3_t64", 1.3, "gain")], key="k1"))
    text = out.getvalue()
    assert "A and B judged the same candidate code (A: candidate bbbbbbbbbb, seed 1; B: candidate bbbbbbbbbb, seed 1)" in text
    assert "neutral: listed or drawn at run time (random-perf-*) only to look for a regression" in text
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:6]] for line in text.splitlines()
            if line.startswith("│") and "k3_t" in line}
    assert rows["k3_t1"] == ["1.200x", "1.100x", "gain", "gain"]
    assert rows["k3_t8"] == ["0.800x", "-", "regression", "-"] and rows["k3_t64"] == ["-", "1.300x", "-", "gain"]
    out.truncate(0)
    out.seek(0)
    cli.compare(result("e-5", perf, key="k1"), result("f-6", perf, key="k2"))
    assert "A and B judged DIFFERENT candidate code" in out.getvalue()  # helper-36: compare did not say so
