"""Fixtures: a throw-away clone of the project with one real accepted and one real rejected candidate.

The session fixture runs the real pipeline once per test session (the good fixture ``lean-torch-cpu``,
accepted, and the ``isolation-edits-test.patch`` bad fixture, rejected by the first guard); every test
then gets its own copy of that repository so merges never leak between tests.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from review_helpers import REVIEWER, Repo, fresh_postgres_db, git

from tests.conftest import (
    CPU_GAIN_JUDGINGS,
    expecting_gain,
    gain_unconfirmed,
    once_per_session,
    set_aside_merged_kernels,
    shared_session_dir,
    use_suite_model_eval,
)

PROJECT = Path(__file__).resolve().parents[2]
TASK = "k3_moe_dispatch"
GOOD = f"tasks/{TASK}/fixtures/good/lean-torch-cpu"
BAD = f"tasks/{TASK}/fixtures/bad/isolation-edits-test.patch"


TEMPLATE_JUDGINGS = CPU_GAIN_JUDGINGS
"""Judgings of the good fixture at most while the template is built: a later one (pooled with the earlier,
workbench/retries.py) only when perf found its gain unconfirmed. Its accept rests on a CPU perf gain, which a
loaded 2-core machine can hide (session 20's rehearsal: mini_t1 1.275x with the interval down to 0.93 at
load 3.4, "judge it on a quiet machine"), and one such run turned every review test into an error."""


def _build_template(root: Path) -> tuple[Path, Path]:
    """Clone the project to ``root`` and judge the good and the bad fixture there; their result paths."""
    from workbench.pipeline import run_candidate

    subprocess.run(["git", "clone", "-q", str(PROJECT), str(root)], check=True)
    git(root, "checkout", "-q", "-B", "main")
    git(root, "config", "user.name", REVIEWER)
    git(root, "config", "user.email", "reviewer@example.org")
    # the queue's mechanics are tested with the good fixture as a new kernel: main's merged ones set aside
    if set_aside_merged_kernels(root):
        git(root, "add", "-A")
        git(root, "commit", "-qm", "test base: the merged kernels set aside")
    # the queue is the subject here, not the model eval: the suite's shorter lengths (tests/conftest.py)
    with pytest.MonkeyPatch.context() as mp:
        use_suite_model_eval(mp)
        for _ in range(TEMPLATE_JUDGINGS):
            with expecting_gain():  # the accept rests on a CPU perf gain
                good, good_path = run_candidate(root, TASK, str(root / GOOD), device="cpu", seed=7)
            failure = good.first_failure()
            if not gain_unconfirmed(failure):
                break
        assert good.accepted, [v.one_line() for v in good.verdicts]
        bad, bad_path = run_candidate(root, TASK, str(root / BAD), device="cpu", seed=7)
    assert not bad.accepted and bad.first_failure().guard == "isolation"
    return good_path, bad_path


@pytest.fixture(scope="session")
def template_repo(tmp_path_factory) -> Repo:
    """Built once per test session, however the tests are spread over pytest-xdist workers: the first
    worker to ask builds it in a folder they all share, under a file lock (a judgment in full costs
    1-3 minutes on the 2-core machine); every test copies it (``repo``), so none writes to it."""
    root = shared_session_dir(tmp_path_factory, "review-template") / "repo"

    def build() -> dict:
        good_path, bad_path = _build_template(root)
        return {"accepted": str(good_path), "rejected": str(bad_path)}

    data = once_per_session(root.with_name("built.json"), build)
    if "error" in data:
        raise RuntimeError(f"building the review template repository failed: {data['error']}")
    return Repo(root, Path(data["accepted"]), Path(data["rejected"]))


@pytest.fixture()
def repo(template_repo: Repo, tmp_path: Path, monkeypatch) -> Repo:
    """A private copy of the template (without its worktrees and queue) with ``WORKBENCH_DB`` unset."""
    monkeypatch.delenv("WORKBENCH_DB", raising=False)
    root = tmp_path / "repo"
    src = template_repo.root

    def ignore(d: str, names: list[str]) -> set[str]:
        if Path(d) == src / ".workbench":
            return {"worktrees", "queue.db", "queue.db-wal", "queue.db-shm"} & set(names)
        return set()

    shutil.copytree(src, root, symlinks=True, ignore=ignore)
    git(root, "worktree", "prune")
    rel = lambda p: root / p.relative_to(src)  # noqa: E731
    return Repo(root, rel(template_repo.accepted), rel(template_repo.rejected))


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    """A new, empty queue's URL: a SQLite file, or a fresh database on the test PostgreSQL server."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'queue.db'}"
    else:
        with fresh_postgres_db() as url:
            yield url
