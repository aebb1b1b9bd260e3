"""Session 7's README-only new user: each finding that was a code defect, as a test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.workbench.test_cli import wb


def test_report_on_a_file_that_is_no_result_says_so(project_repo, tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{}")
    proc = wb(project_repo, "report", str(p))
    assert proc.returncode == 2
    assert "not a workbench result" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_an_empty_patch_says_it_is_empty_not_gits_advice(project_repo, tmp_path):
    p = tmp_path / "empty.patch"
    p.write_text("")
    proc = wb(project_repo, "run", "k3_moe_dispatch", "-c", str(p), "--device", "cpu")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "the file is empty" in proc.stderr and "--allow-empty" not in proc.stderr


@pytest.mark.slow
def test_selftest_takes_a_fixture_by_its_file_name_and_a_base(project_repo):
    head = wb(project_repo, "tasks").returncode  # the checkout works at all
    assert head == 0
    proc = wb(project_repo, "selftest", "k3_moe_dispatch", "-f", "isolation-edits-test.patch", "--base", "HEAD",
              "--device", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 as expected" in proc.stdout and "isolation-edits-test" in proc.stdout


@pytest.mark.slow
def test_the_reproduce_command_names_the_candidate_by_its_absolute_path(project_repo):
    rel = "tasks/k3_moe_dispatch/fixtures/bad/isolation-edits-test.patch"
    proc = wb(project_repo, "run", "k3_moe_dispatch", "-c", rel, "--device", "cpu")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    result = json.loads(Path(proc.stdout.strip().splitlines()[-1]).read_text())
    assert f"--candidate {project_repo / rel} " in result["command"], result["command"]
