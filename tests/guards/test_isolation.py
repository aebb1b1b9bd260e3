"""Isolation guard: allowed changes pass; tests, harness, conftest/.pth, symlinks out, blobs fail."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from guards.base import GuardContext
from guards.isolation import IsolationGuard, glob_match, path_problem
from guards.verdict import Status
from tests.conftest import git
from workbench.taskspec import ALWAYS_FORBIDDEN, load_task

KDIR = "k3_model/kernels/moe_dispatch"


def _judge(repo: Path, write) -> Verdict:  # noqa: F821
    base = git(repo, "rev-parse", "HEAD")
    write(repo)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "candidate")
    cand = git(repo, "rev-parse", "HEAD")
    task = load_task(repo, "k3_moe_dispatch")
    ctx = GuardContext(task=task, repo_root=repo, worktree=repo, base_commit=base, candidate_commit=cand,
                       device="cpu", seed=0)
    return IsolationGuard().check(ctx)


def _w(rel: str, text: str = "x = 1\n"):
    def write(repo: Path) -> None:
        p = repo / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return write


def test_allowed_change_passes(fresh_repo):
    v = _judge(fresh_repo, _w(f"{KDIR}/__init__.py"))
    assert v.status is Status.PASS
    assert [e.path for e in v.evidence] == [f"{KDIR}/__init__.py"]


@pytest.mark.parametrize("rel, why", [
    ("tests/test_extra.py", "always forbidden (tests/**)"),
    ("k3_model/ops/moe_dispatch.py", "outside allowed_paths"),
    ("k3_model/dispatch.py", "outside allowed_paths"),
    (f"{KDIR}/conftest.py", "always forbidden (**/conftest.py)"),
    (f"{KDIR}/sitecustomize.py", "always forbidden (**/sitecustomize.py)"),
    (f"{KDIR}/evil.pth", "always forbidden (**/*.pth)"),
    ("guards/perf.py", "always forbidden (guards/**)"),
    ("pyproject.toml", "always forbidden (pyproject.toml)"),
    (".ci/run", "always forbidden (.ci/**)"),
])
def test_forbidden_path_fails_naming_it(fresh_repo, rel, why):
    v = _judge(fresh_repo, lambda r: (_w(f"{KDIR}/__init__.py")(r), _w(rel)(r)))
    assert v.status is Status.FAIL
    bad = [e for e in v.evidence if e.name == "forbidden_path"]
    assert [e.path for e in bad] == [rel]
    assert why in bad[0].value
    assert rel in v.summary


def test_symlink_leaving_allowed_paths_fails(fresh_repo):
    def write(repo: Path) -> None:
        d = repo / KDIR
        d.mkdir(parents=True, exist_ok=True)
        os.symlink("../../ops/moe_dispatch.py", d / "alias.py")
    v = _judge(fresh_repo, write)
    assert v.status is Status.FAIL
    assert any(e.name == "symlink_escapes" and e.path == f"{KDIR}/alias.py" for e in v.evidence)


def test_symlink_to_absolute_path_fails(fresh_repo):
    def write(repo: Path) -> None:
        d = repo / KDIR
        os.symlink("/etc/passwd", d / "abs.py")
    v = _judge(fresh_repo, write)
    assert v.status is Status.FAIL and v.evidence[0].value.endswith("(absolute target)")


def test_binary_blob_fails(fresh_repo):
    def write(repo: Path) -> None:
        (repo / KDIR / "kernel.so").write_bytes(b"\x7fELF\x00\x00binary")
    v = _judge(fresh_repo, write)
    assert v.status is Status.FAIL
    assert v.evidence[0].name == "binary_blob" and v.evidence[0].unit == "bytes"


def test_deleting_a_test_fails(fresh_repo):
    def write(repo: Path) -> None:
        (repo / "tests" / "guards" / "test_isolation.py").unlink()
    v = _judge(fresh_repo, write)
    assert v.status is Status.FAIL and v.evidence[0].path == "tests/guards/test_isolation.py"


def test_rename_out_of_allowed_path_fails_on_both_sides(fresh_repo):
    def write(repo: Path) -> None:
        git(repo, "mv", f"{KDIR}/README.md", "k3_model/README_moved.md")
    v = _judge(fresh_repo, write)
    assert v.status is Status.FAIL
    assert "k3_model/README_moved.md" in {e.path for e in v.evidence}


def test_empty_diff_fails(fresh_repo):
    base = git(fresh_repo, "rev-parse", "HEAD")
    task = load_task(fresh_repo, "k3_moe_dispatch")
    v = IsolationGuard().check(GuardContext(task=task, repo_root=fresh_repo, worktree=fresh_repo, base_commit=base,
                                            candidate_commit=base, device="cpu", seed=0))
    assert v.status is Status.FAIL and "changes nothing" in v.summary


@pytest.mark.parametrize("path, pattern, ok", [
    ("k3_model/kernels/moe_dispatch/a.py", "k3_model/kernels/moe_dispatch/**", True),
    ("k3_model/kernels/moe_dispatch/sub/a.py", "k3_model/kernels/moe_dispatch/**", True),
    ("k3_model/kernels/moe_dispatchX/a.py", "k3_model/kernels/moe_dispatch/**", False),
    ("conftest.py", "**/conftest.py", True),
    ("a/b/conftest.py", "**/conftest.py", True),
    ("a/b/not_conftest.py", "**/conftest.py", False),
    ("x.pth", "**/*.pth", True),
    ("k3_model/a.py", "k3_model/*.py", True),
    ("k3_model/sub/a.py", "k3_model/*.py", False),
])
def test_glob_match(path, pattern, ok):
    assert glob_match(path, pattern) is ok


def test_dotdot_paths_are_refused():
    assert path_problem("k3_model/kernels/moe_dispatch/../../dispatch.py", ("k3_model/kernels/moe_dispatch/**",),
                        ALWAYS_FORBIDDEN) == "path leaves the repository"


def test_a_file_at_the_root_names_where_an_overlay_puts_it(fresh_repo):
    """An overlay folder with the kernel at its root (helper-22, session 21: /tmp/flat/__init__.py) fails, and the
    summary says the folder mirrors the repository and where the file belongs."""
    v = _judge(fresh_repo, _w("my_kernel.py"))
    assert v.status is Status.FAIL
    assert "first: my_kernel.py (outside allowed_paths" in v.summary
    assert f"An overlay folder mirrors the repository: a file for {KDIR}/** goes at that path inside the folder " \
           f"(e.g. {KDIR}/my_kernel.py)." in v.summary
    v = _judge(fresh_repo, _w("k3_model/ops/other.py"))  # a path with folders: no such hint
    assert v.status is Status.FAIL and "overlay folder" not in v.summary
