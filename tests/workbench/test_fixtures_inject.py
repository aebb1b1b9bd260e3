"""Inject fixtures: a base fixture plus the bug as exact replacements, materialized into an overlay."""

from __future__ import annotations

from pathlib import Path

import pytest

from workbench.errors import CandidateError
from workbench.fixtures import INJECT_SUFFIX, list_fixtures, materialize_inject, overlay_source
from workbench.taskspec import load_task
from workbench.worktree import classify_source, create_candidate, open_repo, remove_candidate

REPO_ROOT = Path(__file__).resolve().parents[2]
KPATH = "k3_model/kernels/moe_dispatch/__init__.py"


def _fixtures(tmp_path: Path, spec: str, base_text: str = "a = 1\nb = 2\nc = 3\n") -> Path:
    base = tmp_path / "fixtures" / "good" / "plain" / "k"
    base.mkdir(parents=True)
    (base / "m.py").write_text(base_text)
    (base / "other.py").write_text("untouched\n")
    bad = tmp_path / "fixtures" / "bad"
    bad.mkdir()
    p = bad / f"correctness-x{INJECT_SUFFIX}"
    p.write_text(spec)
    return p


def test_the_edits_apply_to_a_copy_of_the_base(tmp_path):
    p = _fixtures(tmp_path, 'base = "plain"\nwhat = "b is wrong"\n[[edit]]\nfile = "k/m.py"\nold = "b = 2\\n"\n'
                            'new = "b = 5\\n"\n[[edit]]\nfile = "k/m.py"\nold = "c = 3"\nnew = "c = 3  # ok"\n')
    m = materialize_inject(p)
    assert (m / "k/m.py").read_text() == "a = 1\nb = 5\nc = 3  # ok\n"
    assert (m / "k/other.py").read_text() == "untouched\n"
    assert (tmp_path / "fixtures/good/plain/k/m.py").read_text() == "a = 1\nb = 2\nc = 3\n"  # base untouched
    assert materialize_inject(p) == m and overlay_source(p) == m  # built once per content
    p.write_text(p.read_text().replace("b = 5", "b = 6"))
    m2 = materialize_inject(p)
    assert m2 != m and (m2 / "k/m.py").read_text().startswith("a = 1\nb = 6\n")


@pytest.mark.parametrize("spec, message", [
    ('base = "plain"\nwhat = "w"\n[[edit]]\nfile = "k/m.py"\nold = "zzz"\nnew = "y"\n', "occurs 0 times in k/m.py"),
    ('base = "plain"\nwhat = "w"\n[[edit]]\nfile = "k/m.py"\nold = " = "\nnew = "="\n', "occurs 3 times in k/m.py"),
    ('base = "plain"\nwhat = "w"\n[[edit]]\nfile = "k/nope.py"\nold = "a"\nnew = "b"\n', "names 'k/nope.py', which base"),
    ('base = "gone"\nwhat = "w"\n[[edit]]\nfile = "k/m.py"\nold = "a"\nnew = "b"\n', "base 'gone' is not a fixture folder"),
    ('base = "plain"\nwhat = "w"\n', "edit: Field required"),
    ('base = "plain"\nwhat = "w"\ncolour = 1\n[[edit]]\nfile = "k/m.py"\nold = "a"\nnew = "b"\n', "colour: Extra inputs"),
    ('base = plain\n', "not valid TOML"),
])
def test_a_malformed_inject_file_is_a_clear_error(tmp_path, spec, message):
    p = _fixtures(tmp_path, spec)
    with pytest.raises(CandidateError, match="Inject fixture") as exc:
        materialize_inject(p)
    assert message in str(exc.value)


def test_the_repositorys_inject_fixtures_are_listed_as_their_materialized_folders():
    fxs = {f.name: f for f in list_fixtures(load_task(REPO_ROOT, "k3_moe_dispatch"))}
    fx = fxs["correctness-cancels-under-bias-shift"]
    assert fx.defined_in == REPO_ROOT / "tasks/k3_moe_dispatch/fixtures/bad" / f"{fx.name}{INJECT_SUFFIX}"
    assert fx.expected_guard == "correctness" and not fx.good
    text = (fx.path / KPATH).read_text()
    assert text.splitlines()[0].startswith('"""BAD FIXTURE: recovers the unbiased scores as (s + b) - b')
    assert "w = choice.gather(1, ids) - e_score_correction_bias[ids]" in text
    base = (REPO_ROOT / "tasks/k3_moe_dispatch/fixtures/good/lean-torch-cpu" / KPATH).read_text()
    assert "w = scores.gather(1, ids)" in base and "w = scores.gather(1, ids)" not in text


def test_an_inject_file_is_a_candidate_source(fresh_repo):
    spec = fresh_repo / "tasks/k3_moe_dispatch/fixtures/bad" / f"correctness-cancels-under-bias-shift{INJECT_SUFFIX}"
    assert classify_source(open_repo(fresh_repo), str(spec)) == "folder"
    cand = create_candidate(fresh_repo, "k3_moe_dispatch", str(spec))
    try:
        assert cand.kind == "folder" and cand.source == str(spec)
        assert (cand.worktree / KPATH).read_text() == (materialize_inject(spec) / KPATH).read_text()
        changed = open_repo(fresh_repo).git.diff("--name-only", cand.base_commit, cand.candidate_commit).split()
        assert changed == [KPATH]  # the overlay's files, never the inject file itself
    finally:
        remove_candidate(fresh_repo, cand.worktree, cand.branch)
