"""Typed guard artifacts: each guard declares what it reads and writes, and is held to it."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from guards.artifacts import ArtifactAccessError, Artifacts, view_for
from guards.base import GuardContext
from guards.verdict import Status, Verdict
from tests.conftest import REPO_ROOT
from workbench.pipeline import default_guards, run_guards
from workbench.taskspec import load_task


class _Writer:
    name, reads, writes = "writer", (), ("changed_paths",)

    def check(self, ctx):
        ctx.artifacts.changed_paths = ["k3_model/kernels/moe_dispatch/__init__.py"]
        return Verdict(guard=self.name, status=Status.PASS, summary="wrote")


class _Sneaky:
    """Writes a field it does not declare."""
    name, reads, writes = "sneaky", ("changed_paths",), ()

    def check(self, ctx):
        ctx.artifacts.perf = []
        return Verdict(guard=self.name, status=Status.PASS, summary="never reached")


class _Peeker:
    """Reads a field it does not declare."""
    name, reads, writes = "peeker", (), ()

    def check(self, ctx):
        _ = ctx.artifacts.changed_paths
        return Verdict(guard=self.name, status=Status.PASS, summary="never reached")


class _Reader:
    name, reads, writes = "reader", ("changed_paths",), ()

    def check(self, ctx):
        return Verdict(guard=self.name, status=Status.PASS, summary=",".join(ctx.artifacts.changed_paths))


def _ctx() -> GuardContext:
    return GuardContext(task=load_task(REPO_ROOT, "k3_moe_dispatch"), repo_root=REPO_ROOT, worktree=REPO_ROOT,
                        base_commit="0" * 40, candidate_commit="0" * 40, device="cpu", seed=1,
                        judged_tree=REPO_ROOT)  # no commit to clone: the children (none here) would use the tree


def test_a_declared_write_reaches_a_later_declared_reader():
    ctx = _ctx()
    verdicts = run_guards(ctx, [_Writer(), _Reader()])
    assert [v.status for v in verdicts] == [Status.PASS, Status.PASS]
    assert verdicts[1].summary == "k3_model/kernels/moe_dispatch/__init__.py"
    assert ctx.artifacts.changed_paths == ["k3_model/kernels/moe_dispatch/__init__.py"]


@pytest.mark.parametrize("guard, field, verb", [(_Sneaky(), "perf", "writes"), (_Peeker(), "changed_paths", "reads")])
def test_an_undeclared_access_is_a_broken_guard_not_a_verdict(guard, field, verb):
    ctx = _ctx()
    verdicts = run_guards(ctx, [_Writer(), guard, _Reader()])
    assert [v.status for v in verdicts] == [Status.PASS, Status.ERROR, Status.SKIP]
    assert f"guard {guard.name!r} {verb} artifact {field!r}" in verdicts[1].summary
    assert ctx.artifacts.perf is None  # the refused write changed nothing


def test_the_view_names_unknown_declarations():
    class _Typo:
        name, reads, writes = "typo", ("case",), ()

    with pytest.raises(ArtifactAccessError, match=r"unknown artifact\(s\) \['case'\]"):
        view_for(Artifacts(), _Typo())


def test_default_guards_declare_one_writer_per_field_and_read_only_what_an_earlier_guard_wrote():
    written: dict[str, str] = {}
    for g in default_guards():
        for f in (*g.reads, *g.writes):
            assert f in Artifacts.FIELDS, (g.name, f)
        for f in g.reads:
            assert f in written, f"{g.name} reads {f!r}, which no earlier guard writes"
        for f in g.writes:
            assert f not in written, f"{f!r} has two writers: {written[f]} and {g.name}"
            written[f] = g.name
    assert written == {"changed_paths": "isolation", "scope": "correctness", "scope_verdict": "correctness",
                       "imported_files": "correctness", "tested_tp_sizes": "correctness", "cases": "correctness",
                       "traces": "correctness", "case_objects": "correctness", "perf": "perf"}


def _accessed_fields(module) -> dict[str, set[str]]:
    """``{"read": ..., "write": ...}``: attribute names used on any ``*.artifacts`` / ``self._artifacts`` in the source."""
    tree = ast.parse(Path(inspect.getsourcefile(module)).read_text())
    out: dict[str, set[str]] = {"read": set(), "write": set()}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and node.value.attr in ("artifacts", "_artifacts"):
            out["write" if isinstance(node.ctx, ast.Store) else "read"].add(node.attr)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                and node.value.attr in ("artifacts", "_artifacts"):
            pytest.fail(f"{module.__name__}: artifacts used as a dict (line {node.lineno}); use the typed fields")
    return out


def test_every_access_in_the_guards_source_is_declared():
    """Also the paths no test run reaches: the source's accesses are a subset of the declaration."""
    import sys

    for g in default_guards():
        used = _accessed_fields(sys.modules[type(g).__module__])
        assert used["write"] <= set(g.writes), (g.name, used["write"] - set(g.writes))
        assert used["read"] <= set(g.reads) | set(g.writes), (g.name, used["read"] - set(g.reads) - set(g.writes))
