"""Helpers shared by the review tests (a uniquely named module: ``conftest`` is not importable safely)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

REVIEWER = "Test Reviewer"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@localhost"}


def git(root: Path, *args: str) -> str:
    """Run git in ``root`` and return stdout (raises on a non-zero exit)."""
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout.strip()


@dataclasses.dataclass
class Repo:
    """A test repository: ``root`` (``main`` checked out), the accepted and rejected result files."""

    root: Path
    accepted: Path
    rejected: Path

    def store(self):
        from workbench.review.service import open_store

        return open_store(self.root)


def make_checkout(dest: Path) -> Path:
    """A minimal kernel-workbench checkout (``tasks/`` and ``k3_model/``, one commit on ``main``) for the
    review commands that need no real result file: no pipeline run, so no perf noise."""
    for d in ("tasks", "k3_model"):
        (dest / d).mkdir(parents=True)
        (dest / d / "README.md").write_text(f"{d}\n")
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-qm", "base")
    return dest


def add_item(store, n: int = 1):
    """Queue ``n`` placeholder items straight into the store (their result files do not exist)."""
    items = []
    for i in range(1, n + 1):
        item, _ = store.add(result_id=f"r{i}", result_path=f"/nowhere/r{i}.json", result_sha256="0" * 64,
                            task_id="k3_moe_dispatch", branch=f"wb/k3_moe_dispatch/{i}", base_commit="a" * 40,
                            candidate_commit="b" * 40, target_branch="main", who="test")
        items.append(item)
    return items


def no_perf_result(dest: Path, *, accepted: bool = True):
    """Write a result file with no perf rows (perf SKIP) under ``dest``; returns its path."""
    from guards.verdict import Status, Verdict
    from workbench.results import CandidateInfo, RunResult, perf_was_judged, write_result

    verdicts = tuple(Verdict(guard=g, status=Status.PASS, summary="ok.")
                     for g in ("isolation", "audit", "correctness", "activation", "model_eval"))
    verdicts += (Verdict(guard="perf", status=Status.SKIP, summary="Not timed on this device."),)
    r = RunResult(
        result_id="k3_moe_dispatch-9-deadbeef", task_id="k3_moe_dispatch", task_spec_sha256="0" * 64,
        candidate=CandidateInfo(source="x", kind="folder", branch="wb/k3_moe_dispatch/9", worktree="/w",
                                base_commit="b" * 40, candidate_commit="c" * 40),
        environment={}, device="cpu", verdicts=verdicts, accepted=accepted, perf_judged=perf_was_judged(verdicts),
        seed=1, command="workbench run k3_moe_dispatch --candidate x --device cpu --seed 1",
        started_at="2026-01-01T00:00:00+00:00", duration_s=1.0)
    return write_result(r, dest)


SKIPS = {  # the SKIP summaries real guards write (guards/model_eval.py, guards/perf.py)
    "model_eval": "K3-mini never calls op 'allreduce_rmsnorm' (k3_model.model.DISPATCHED_OPS), so the model eval "
                  "does not apply.",
    "perf": "Performance of this task is judged on cuda only, not cpu: a CPU verdict would be a coin toss.",
}


def candidate_result(root: Path, *, skipped: tuple[str, ...] = ("model_eval", "perf"), n: int = 9,
                     set_aside: str | None = None) -> Path:
    """Commit a one-file candidate on ``wb/k3_moe_dispatch/<n>`` of a :func:`make_checkout` repository and
    write an accepted result for it under ``root/.workbench/results``: every guard PASS except ``skipped``
    (SKIP, with :data:`SKIPS`' summaries). ``main`` stays checked out at the base; returns the result path."""
    from guards.verdict import Evidence, Status, Verdict
    from workbench.results import CandidateInfo, RunResult, perf_was_judged, write_result

    base = git(root, "rev-parse", "main")
    branch = f"wb/k3_moe_dispatch/{n}"
    git(root, "checkout", "-q", "-b", branch)
    f = root / "k3_model" / "kernels" / "moe_dispatch" / "__init__.py"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(f"# candidate {n}\n")
    git(root, "add", str(f.relative_to(root)))
    git(root, "commit", "-qm", f"candidate {n}")
    cand = git(root, "rev-parse", "HEAD")
    git(root, "checkout", "-q", "main")
    verdicts = tuple(
        Verdict(guard=g, status=Status.SKIP, summary=SKIPS[g]) if g in skipped
        else Verdict(guard=g, status=Status.PASS, summary="ok.",
                     evidence=(Evidence(name="x", value=1),) if g == "perf" else ())
        for g in ("isolation", "audit", "correctness", "activation", "model_eval", "perf"))
    r = RunResult(
        result_id=f"k3_moe_dispatch-{n}-{cand[:8]}", task_id="k3_moe_dispatch", task_spec_sha256="0" * 64,
        candidate=CandidateInfo(source="x", kind="folder", branch=branch, worktree="/w", base_commit=base,
                                candidate_commit=cand, changed_paths=(str(f.relative_to(root)),),
                                set_aside=set_aside),
        environment={}, device="cpu", verdicts=verdicts, accepted=True, perf_judged=perf_was_judged(verdicts),
        seed=1, command="workbench run k3_moe_dispatch --candidate x --device cpu --seed 1",
        started_at="2026-01-01T00:00:00+00:00", duration_s=1.0)
    return write_result(r, root / ".workbench" / "results")


@contextlib.contextmanager
def fresh_postgres_db() -> Iterator[str]:
    """A new database on the ``WORKBENCH_TEST_POSTGRES_URL`` server, dropped afterwards; yields its URL.

    Skips the test when the variable is unset or psycopg is missing, except under ``CI=true`` (fails: CI
    starts the server in .ci/install-services.sh).
    """
    import pytest
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    from workbench import envs

    admin_url = envs.TEST_POSTGRES_URL.read()
    why = None if admin_url else (f"{envs.TEST_POSTGRES_URL.name} is not set: start a server with "
                                  "`bash .ci/install-services.sh` and `source .ci/services.env`")
    if why is None:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            why = "psycopg is not installed (pip install -e '.[pool]')"
    if why:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true: the PostgreSQL store tests need a real server; {why}.")
        pytest.skip(why)
    name = f"wb_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
        yield make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()
