"""The CLI's contract: exit 0 accepted / 1 rejected / 2 bad input; the last line is the result path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GOOD = "tasks/k3_moe_dispatch/fixtures/good/lean-torch-cpu"
BAD = "tasks/k3_moe_dispatch/fixtures/bad/correctness-mutates-input"


def wb(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKBENCH_")}
    return subprocess.run([sys.executable, "-m", "workbench", *args], cwd=repo, capture_output=True, text=True,
                          env=env, timeout=600)


def test_run_accepts_good_and_prints_result_path_last(project_repo):
    p = wb(project_repo, "run", "k3_moe_dispatch", "--candidate", GOOD, "--device", "cpu")
    assert p.returncode == 0, p.stdout + p.stderr
    last = Path(p.stdout.strip().splitlines()[-1])
    assert last.suffix == ".json" and last.is_file()
    assert json.loads(last.read_text())["accepted"] is True
    r = wb(project_repo, "report", str(last))
    assert r.returncode == 0 and "| perf | PASS |" in r.stdout


def test_run_rejects_bad_with_exit_1(project_repo):
    p = wb(project_repo, "run", "k3_moe_dispatch", "--candidate", BAD, "--device", "cpu")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "correctness  FAIL" in p.stdout and "mutated input(s) router_logits" in p.stdout
    assert Path(p.stdout.strip().splitlines()[-1]).is_file()


@pytest.mark.parametrize("args, message", [
    (["run", "no_such_task", "--candidate", GOOD], "known tasks: k3_allreduce_rmsnorm, k3_dspark_verify, k3_moe_dispatch"),
    (["run", "k3_moe_dispatch", "--candidate", "missing.patch"], "not a patch file, not a folder"),
    (["run", "k3_moe_dispatch", "--candidate", GOOD, "--device", "tpu"], "--device 'tpu': expected cpu, cuda or auto"),
    (["report", "nope.json"], "does not exist"),
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


def test_selftest_skips_a_fixture_already_merged(fresh_repo):
    import shutil

    from tests.conftest import git

    src = fresh_repo / GOOD / "k3_model/kernels/moe_dispatch/__init__.py"
    shutil.copy(src, fresh_repo / "k3_model/kernels/moe_dispatch/__init__.py")
    git(fresh_repo, "add", "-A")
    git(fresh_repo, "commit", "-qm", "merge the good kernel")
    p = wb(fresh_repo, "selftest", "k3_moe_dispatch", "-f", "lean-torch-cpu")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "lean-torch-cpu is already merged at the base" in p.stdout


def test_tables_are_not_truncated_when_piped(project_repo):
    p = wb(project_repo, "tasks")
    assert "k3_model/kernels/moe_dispatch/**" in p.stdout and "k3_model.ops.moe_dispatch:moe_route_dispatch" in p.stdout
