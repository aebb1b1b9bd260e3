"""Mutation study: which fraction of non-equivalent mutants of each task's good CPU fixture each guard kills.

Every mutant is the fixture with one rewrite in the kernel's own source (an arithmetic, comparison,
boolean or min/max operator swapped, a constant tweaked, a unary operator dropped; never in a
docstring, an import, an annotation or the ``SCOPE`` declaration), judged through the project's own
guards (``guards.correctness.CorrectnessGuard``, then ``guards.activation.ActivationGuard`` when
correctness passes, via ``workbench.pipeline.run_guards``) on ``--device cpu``, in a private copy of
``k3_model/`` with the fixture overlaid. Two modes, with the same run-time seed:

- ``before``: the fixed workloads only (the task's ``correctness.random_draws`` set to 0 for the study);
- ``after``: the full correctness verdict of a real run (fixed workloads plus the random domain draws).

A mutant no guard kills in ``after`` is probed: the mutant and the unmutated fixture run the same
fixed workloads plus ``--probe-draws`` random domain configurations (another seed, so other inputs) through the guard's child, and their
outputs (and the inputs after each call) are compared bit for bit. Identical everywhere: "likely
equivalent", left out of every denominator and listed for review. Otherwise the survivor is
non-equivalent; the probe also says whether the guard's own check rejects it on the larger batch
(``wrong_on_probe``: the run-time draws missed a detectable bug) or not (``differs_but_passes``: the
outputs differ from the fixture's only inside the contract's freedoms, e.g. tolerance or order).

Mutants killed by a child problem (import error, crash, timeout) or only by calls that raised are
counted as killed and also reported as "trivially killed"; each score is given with and without them.

The study changes no guard behaviour: the per-mode task spec is a copy with another ``random_draws``
and, for the child, ``--child-timeout`` seconds (a mutant that loops forever is killed by the time
limit in a real run too, only later); the shrinking of a failing random draw is skipped (it adds a
smaller failing configuration to the report and never changes the verdict).

Usage (from the repository root)::

    python bench/mutation_study.py --tasks k3_moe_dispatch,k3_dspark_verify,k3_allreduce_rmsnorm \\
        --max-mutants 40 --seed 19 --jobs 14 --machine h200 --out-dir bench/results/h200

Writes ``<out-dir>/mutation_study.json`` and ``<out-dir>/mutation_study.md``.

Source: issue 19 item 5 ("Measure the power": a mutation study of each task's good CPU fixture,
target >= 95% of non-equivalent mutants killed by correctness alone).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import copy
import dataclasses
import json
import multiprocessing
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # run as a file from the repo root

DEFAULT_TASKS = ("k3_moe_dispatch", "k3_dspark_verify", "k3_allreduce_rmsnorm")
GOOD_CPU_FIXTURE = {"k3_moe_dispatch": "lean-torch-cpu", "k3_dspark_verify": "lazy-torch-cpu",
                    "k3_allreduce_rmsnorm": "oneshot-twoshot-cpu"}
"""The good fixture of each task that is judged on CPU (``tasks/<id>/fixtures/requires.toml``)."""

# ---------------------------------------------------------------------------------------------------------
# mutant generation

BINOP_SWAP: dict[type, type] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
    ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.BitAnd: ast.BitOr, ast.BitOr: ast.BitAnd,
    ast.BitXor: ast.BitAnd, ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.MatMult: ast.Mult,
}
"""Arithmetic and bitwise operator rewrites (one each; ``&``/``|`` are the tensor masks' and/or)."""
CMP_SWAP: dict[type, type] = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}
"""Comparison rewrites: boundary shifts (``<`` / ``<=``) and negations (``==`` / ``!=``)."""
MINMAX_SWAP = {"min": "max", "max": "min", "amin": "amax", "amax": "amin", "clamp_min": "clamp_max",
               "clamp_max": "clamp_min", "argmin": "argmax", "argmax": "argmin"}
"""Called names or methods swapped (``min(a, b)`` -> ``max(a, b)``, ``x.clamp_min(0)`` -> ``x.clamp_max(0)``)."""
_OP_TEXT = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Mod: "%",
            ast.Pow: "**", ast.BitAnd: "&", ast.BitOr: "|", ast.BitXor: "^", ast.LShift: "<<", ast.RShift: ">>",
            ast.MatMult: "@", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==",
            ast.NotEq: "!=", ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in",
            ast.And: "and", ast.Or: "or", ast.USub: "-", ast.Not: "not", ast.Invert: "~"}
PROTECTED_NAMES = frozenset({"SCOPE", "__all__"})
"""Module-level names whose assignment is never mutated (the declared scope is checked by activation)."""


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One rewrite of one source file.

    Attributes:
        path: the file's path relative to the fixture root (= inside the candidate's checkout).
        index: position in the file's mutant list (in source order), stable for a given source.
        line, col, end_line, end_col: the rewritten node's span (1-based lines, 0-based columns).
        operator: the rewrite's kind and direction, e.g. ``binop + -> -``, ``const 1 -> 0``.
        original, replacement: the original source text of the span and its replacement.
        source: the whole mutated file.
    """

    path: str
    index: int
    line: int
    col: int
    end_line: int
    end_col: int
    operator: str
    original: str
    replacement: str
    source: str = dataclasses.field(repr=False, compare=False)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d


def protected_lines(tree: ast.Module) -> set[int]:
    """Lines never mutated: docstrings, imports and the assignments of :data:`PROTECTED_NAMES`."""
    out: set[int] = set()

    def span(n: ast.AST) -> None:
        out.update(range(n.lineno, (n.end_lineno or n.lineno) + 1))

    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                span(body[0])
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            span(node)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in PROTECTED_NAMES for t in targets):
                span(node)
    return out


def _skipped_nodes(tree: ast.Module) -> set[int]:
    """ids of nodes inside annotations and f-strings (never mutated)."""
    roots: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            roots.append(node.returns)
        if isinstance(node, ast.arg) and node.annotation is not None:
            roots.append(node.annotation)
        if isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
        if isinstance(node, ast.JoinedStr):
            roots.append(node)
    return {id(n) for r in roots for n in ast.walk(r)}


def _const_variants(value: Any) -> list[tuple[Any, str]]:
    """Replacement constants for ``value`` with their labels (strings, bytes, None and Ellipsis: none)."""
    if isinstance(value, bool):
        return [(not value, f"const {value} -> {not value}")]
    if isinstance(value, int):
        new = 1 if value == 0 else 0 if value == 1 else value + 1
        return [(new, f"const {value} -> {new}")]
    if isinstance(value, float):
        if value == 0.0:
            return [(1.0, f"const {value!r} -> 1.0")]
        return [(value * 2, f"const {value!r} -> {value * 2!r}"), (-value, f"const {value!r} -> {-value!r}")]
    return []


def _variants(node: ast.AST) -> list[tuple[ast.AST, str]]:
    """The rewritten copies of one node, with their labels (no rewrite applies: empty)."""
    out: list[tuple[ast.AST, str]] = []
    if isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in BINOP_SWAP:
        new_op = BINOP_SWAP[type(node.op)]
        n = copy.copy(node)
        n.op = new_op()
        kind = "augassign" if isinstance(node, ast.AugAssign) else "binop"
        suffix = "=" if kind == "augassign" else ""
        out.append((n, f"{kind} {_OP_TEXT[type(node.op)]}{suffix} -> {_OP_TEXT[new_op]}{suffix}"))
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in CMP_SWAP:
                n = copy.copy(node)
                n.ops = [*node.ops[:i], CMP_SWAP[type(op)](), *node.ops[i + 1:]]
                out.append((n, f"compare {_OP_TEXT[type(op)]} -> {_OP_TEXT[CMP_SWAP[type(op)]]}"))
    elif isinstance(node, ast.BoolOp):
        new = ast.Or if isinstance(node.op, ast.And) else ast.And
        n = copy.copy(node)
        n.op = new()
        out.append((n, f"boolop {_OP_TEXT[type(node.op)]} -> {_OP_TEXT[new]}"))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in (ast.USub, ast.Not, ast.Invert):
        out.append((node.operand, f"drop unary {_OP_TEXT[type(node.op)]}"))
    elif isinstance(node, ast.Constant):
        for value, label in _const_variants(node.value):
            # a negative literal is a unary minus in the syntax tree (``-1.0`` parses as USub(1.0))
            new = ast.UnaryOp(op=ast.USub(), operand=ast.Constant(value=-value)) if value < 0 else ast.Constant(value)
            out.append((new, label))
    elif isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Name) and f.id in MINMAX_SWAP:
            n = copy.copy(node)
            n.func = ast.Name(id=MINMAX_SWAP[f.id], ctx=ast.Load())
            out.append((n, f"call {f.id} -> {MINMAX_SWAP[f.id]}"))
        elif isinstance(f, ast.Attribute) and f.attr in MINMAX_SWAP:
            n = copy.copy(node)
            n.func = ast.Attribute(value=f.value, attr=MINMAX_SWAP[f.attr], ctx=ast.Load())
            out.append((n, f"call .{f.attr} -> .{MINMAX_SWAP[f.attr]}"))
    return out


def _offsets(source: str) -> list[int]:
    """Character offset of the start of each line (index 0 = line 1)."""
    starts, pos = [], 0
    for line in source.splitlines(keepends=True):
        starts.append(pos)
        pos += len(line)
    starts.append(pos)
    return starts


def _utf8_col_to_char(line_text: str, col: int) -> int:
    return len(line_text.encode("utf-8")[:col].decode("utf-8"))


def _replace_in(tree: ast.AST, index: int, new: ast.AST) -> ast.AST:
    """A copy of ``tree`` with its ``index``-th node (``ast.walk`` order) replaced by ``new``."""
    tree = copy.deepcopy(tree)
    target = list(ast.walk(tree))[index]
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is target:
                setattr(parent, field, new)
                return tree
            if isinstance(value, list):
                for i, v in enumerate(value):
                    if v is target:
                        value[i] = new
                        return tree
    raise ValueError(f"node {index} has no parent")  # the module itself is never a mutation site


def mutants_of(source: str, path: str = "<src>") -> list[Mutant]:
    """Every single-rewrite mutant of ``source``, in source order, deduplicated by the mutated text.

    Each mutant's text is the original with only the rewritten node's span replaced (parenthesised
    when it is an expression, so precedence never changes); it is checked to parse to exactly the
    rewritten syntax tree.

    Args:
        source: a Python module's text.
        path: the file's path, recorded in each mutant.

    Raises:
        SyntaxError: ``source`` does not parse.
        AssertionError: a spliced mutant does not parse to its rewritten tree (a bug of this mutator).
    """
    tree = ast.parse(source)
    protected = protected_lines(tree)
    skipped = _skipped_nodes(tree)
    lines = source.splitlines(keepends=True)
    starts = _offsets(source)
    nodes = list(ast.walk(tree))
    sites = []
    for i, node in enumerate(nodes):
        if id(node) in skipped or not hasattr(node, "lineno"):
            continue
        if set(range(node.lineno, (node.end_lineno or node.lineno) + 1)) & protected:
            continue
        for new, label in _variants(node):
            sites.append((node.lineno, node.col_offset, i, node, new, label))
    sites.sort(key=lambda s: (s[0], s[1], s[2]))
    out: list[Mutant] = []
    seen: set[str] = {source}
    for line, col, i, node, new, label in sites:
        a = starts[node.lineno - 1] + _utf8_col_to_char(lines[node.lineno - 1], node.col_offset)
        b = starts[node.end_lineno - 1] + _utf8_col_to_char(lines[node.end_lineno - 1], node.end_col_offset)
        text = ast.unparse(new)
        if not isinstance(node, ast.stmt):
            text = f"({text})"
        mutated = source[:a] + text + source[b:]
        if mutated in seen:
            continue
        want = ast.dump(_replace_in(tree, i, new))
        assert ast.dump(ast.parse(mutated)) == want, f"splice of {label} at {path}:{line}:{col} broke the tree"
        seen.add(mutated)
        out.append(Mutant(path=path, index=len(out), line=line, col=col, end_line=node.end_lineno,
                          end_col=node.end_col_offset, operator=label, original=source[a:b], replacement=text,
                          source=mutated))
    return out


def fixture_dir(task_id: str, root: Path = REPO_ROOT) -> Path:
    """``tasks/<task_id>/fixtures/good/<the CPU fixture>``.

    Raises:
        KeyError: no good CPU fixture is known for ``task_id``.
    """
    return root / "tasks" / task_id / "fixtures" / "good" / GOOD_CPU_FIXTURE[task_id]


def fixture_sources(fixture: Path) -> list[str]:
    """The fixture's Python files (the kernel's own sources), relative to the fixture root, sorted."""
    return sorted(str(p.relative_to(fixture)) for p in fixture.rglob("*.py") if "__pycache__" not in p.parts)


def sample_mutants(task_id: str, fixture: Path, max_mutants: int, seed: int) -> tuple[list[Mutant], int]:
    """At most ``max_mutants`` mutants of the fixture's sources, chosen by ``seed``; and the population size.

    Deterministic: the same sources, ``max_mutants`` and ``seed`` give the same mutants (in source order).
    """
    population: list[Mutant] = []
    for rel in fixture_sources(fixture):
        population += mutants_of((fixture / rel).read_text(encoding="utf-8"), rel)
    rng = random.Random(f"mutation-study|{seed}|{task_id}")
    chosen = population if len(population) <= max_mutants else rng.sample(population, max_mutants)
    chosen.sort(key=lambda m: (m.path, m.line, m.col, m.index))
    return chosen, len(population)


# ---------------------------------------------------------------------------------------------------------
# judging (in worker processes)

@dataclasses.dataclass(frozen=True)
class JudgeJob:
    """One unit of work for a worker: the fixture with ``files`` written over it.

    Attributes:
        key: the record this job belongs to (``<task>#<path>#<index>``, or ``<task>#fixture``).
        files: relative path -> text written over the fixture (empty: the unmutated fixture).
        modes: what to do, in order: ``before``, ``after`` (each a judging by correctness, then activation
            when correctness passes) and ``probe``; with ``chain`` a mode runs only while no earlier one killed.
        chain: stop at the first killing mode (a mutant killed on the fixed workloads is killed by the full
            verdict too: same seed, so the same fixed configurations with the same inputs; recorded as inferred).
    """

    key: str
    task_id: str
    seed: int
    files: dict[str, str]
    child_timeout_s: float
    modes: tuple[str, ...] = ("before", "after", "probe")
    chain: bool = True
    probe_draws: int = 64
    probe_seed: int = 0
    deadline: float | None = None
    """``time.time()`` after which no further mode of this job starts (``--budget-s``); ``None``: no limit."""

def study_task(task, mode: str, *, child_timeout_s: float, probe_draws: int = 0):
    """The task spec a study mode judges with: ``before`` no random draws, ``after`` the task's own,
    ``probe`` ``probe_draws`` draws; the correctness child's time limit is ``child_timeout_s`` in every mode.
    A copy: the task on disk and every normal run are unchanged."""
    draws = {"before": 0, "after": task.correctness.random_draws, "probe": probe_draws}[mode]
    return task.model_copy(update={
        "correctness": task.correctness.model_copy(update={"random_draws": draws}),
        "timeouts": task.timeouts.model_copy(update={"correctness_s": child_timeout_s}),
    })


def _checkout(job: JudgeJob, tmp: Path) -> Path:
    """A private candidate checkout: the trusted ``k3_model/`` and ``kernels/`` (the guard child imports the
    harness's ``kernels.timing`` from the worktree, as in a real candidate's checkout), the fixture over
    it, then ``job.files``."""
    wt = tmp / "wt"
    for pkg in ("k3_model", "kernels"):
        shutil.copytree(REPO_ROOT / pkg, wt / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(fixture_dir(job.task_id), wt, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, text in job.files.items():
        (wt / rel).write_text(text, encoding="utf-8")
    return wt


def _kill_kind(verdict, cases: list[dict]) -> str:
    """How a FAIL came about: ``timeout`` (the child ran past its time limit), ``problem`` (the child did
    not complete otherwise: import error, crash),
    ``raised`` (every failing configuration failed only by calls that raised) or ``wrong`` (a wrong value,
    a mutated input, or rank disagreement somewhere)."""
    problem = next((str(e.value) for e in verdict.evidence if e.name == "child_problem"), None)
    if problem is not None:
        return "timeout" if "s limit (wall clock)" in problem else "problem"
    failing = [c for c in cases if not c.get("passed", True)]
    if failing and all(all("] raised " in m for m in c.get("mismatches", ())) for c in failing):
        return "raised"
    return "wrong"


def bits_digest(t: Any) -> str:
    """``dtype shape sha256`` of a tensor's bits (NaN payloads and the sign of zero included); other values:
    their ``repr``."""
    import hashlib

    import torch

    if not isinstance(t, torch.Tensor):
        return repr(t)
    raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{t.dtype} {tuple(t.shape)} {hashlib.sha256(raw).hexdigest()}"


def _probe_outputs(by_name: dict, cases) -> dict:
    """Per case name: per rank, per call, digests of the outputs and of the inputs after the call, and
    the error text."""
    out = {}
    for c in cases:
        ranks = by_name.get(c.name) or []
        out[c.name] = [[{"outputs": {k: bits_digest(v) for k, v in call.get("outputs", {}).items()},
                         "inputs_after": {k: bits_digest(v) for k, v in call.get("inputs_after", {}).items()},
                         "error": call.get("error")} for call in rc.get("calls", [])] for rc in ranks]
    return out


def same_probe(a: dict, b: dict) -> tuple[bool, str]:
    """Whether two :func:`_probe_outputs` results hold the same bits everywhere; else the first difference."""
    if set(a) != set(b):
        return False, "different configurations"
    for name in a:
        ra, rb = a[name], b.get(name)
        if rb is None or len(ra) != len(rb):
            return False, f"{name}: different number of ranks"
        for r, (ca, cb) in enumerate(zip(ra, rb)):
            if len(ca) != len(cb):
                return False, f"{name} rank {r}: different number of calls"
            for k, (x, y) in enumerate(zip(ca, cb)):
                if (x["error"] is None) != (y["error"] is None):
                    return False, f"{name} rank {r} call {k}: one raised"
                for part in ("outputs", "inputs_after"):
                    if set(x[part]) != set(y[part]):
                        return False, f"{name} rank {r} call {k}: {part} names differ"
                    for t in x[part]:
                        if x[part][t] != y[part][t]:
                            return False, f"{name} rank {r} call {k}: {part} {t} differs"
    return True, ""


def _judge_mode(job: JudgeJob, mode: str) -> dict[str, Any]:
    """One judging (``before`` or ``after``) or one probe of the job's checkout."""
    from guards.activation import ActivationGuard
    from guards.base import GuardContext
    from guards.cases import ShrinkResult, correctness_cases, load_task_module
    from guards.correctness import CorrectnessGuard
    from guards.verdict import Status
    from workbench.pipeline import run_guards
    from workbench.taskspec import load_task

    class StudyCorrectness(CorrectnessGuard):
        """The correctness guard without the shrinking of a failing random draw (report only, not the status)."""

        def _shrink(self, ctx, ref, case):
            return ShrinkResult(case.workload, (), 0)

    t0 = time.monotonic()
    task = study_task(load_task(REPO_ROOT, job.task_id), mode, child_timeout_s=job.child_timeout_s,
                      probe_draws=job.probe_draws)
    with tempfile.TemporaryDirectory(prefix="wb-mutant-") as tmp:
        wt = _checkout(job, Path(tmp))
        # the study's checkout is a plain copy already (no git worktree): the children import from it as is
        ctx = GuardContext(task=task, repo_root=REPO_ROOT, worktree=wt, base_commit="study", candidate_commit="study",
                           device="cpu", seed=job.probe_seed if mode == "probe" else job.seed, judged_tree=wt)
        ctx.artifacts.changed_paths = fixture_sources(fixture_dir(job.task_id))  # what isolation would list
        if mode != "probe":
            verdicts = run_guards(ctx, [StudyCorrectness(), ActivationGuard()])
            killer = next((v for v in verdicts if v.status in (Status.FAIL, Status.ERROR)), None)
            cases = ctx.artifacts.cases or []
            return {
                "wall_s": round(time.monotonic() - t0, 2),
                "verdicts": [{"guard": v.guard, "status": v.status.value, "summary": v.summary[:600]} for v in verdicts],
                "killed_by": killer.guard if killer else None,
                "kill_kind": (_kill_kind(killer, cases) if killer.status is Status.FAIL else "guard_error")
                if killer else None,
                "cases": len(cases), "random_cases": sum(c["name"].startswith("random-") for c in cases),
            }
        guard = StudyCorrectness()
        # the fixed workloads too: the child refuses a declared scope beyond what the run tests (a TP size
        # no draw happens to use), and bits of the fixed configurations under another seed's inputs count as well
        cases = correctness_cases(task, ctx.seed)
        by_name, failed, _, _ = guard._run(ctx, cases)
        rec: dict[str, Any] = {"probe_cases": len(cases), "probe_seed": ctx.seed}
        if failed is not None:
            rec.update(status="problem", summary=failed.summary[:600], wall_s=round(time.monotonic() - t0, 2))
            return rec
        ref = load_task_module(task, "reference")
        wrong = [(c.name, m[0]) for c in cases if (m := guard._judge_case(task, ref, c, by_name.get(c.name) or [])[0])]
        rec.update(wrong_cases=len(wrong), first_wrong=f"{wrong[0][0]}: {wrong[0][1][:300]}" if wrong else None,
                   digests=_probe_outputs(by_name, cases), wall_s=round(time.monotonic() - t0, 2))
        return rec


def judge(job: JudgeJob) -> dict[str, Any]:
    """Run a job's modes (in a worker process); returns ``{"key", mode: record, ...}`` (JSON-able but for
    nothing: digests are strings). A mode skipped by ``chain`` is ``{"inferred_from": <killing mode>}``."""
    import torch

    torch.set_num_threads(1)  # this process only computes references; the children run the candidate
    out: dict[str, Any] = {"key": job.key}
    killed_in = None
    for mode in job.modes:
        if killed_in is not None and job.chain:
            if mode != "probe":
                out[mode] = {**out[killed_in], "inferred_from": killed_in, "wall_s": 0.0}
            continue
        if job.deadline is not None and time.time() > job.deadline:
            out[mode] = {"error": "not run: --budget-s reached before this mode started"}
            break
        try:
            out[mode] = _judge_mode(job, mode)
        except Exception as exc:  # the study's own failure for this job: recorded, never hidden
            out[mode] = {"error": f"{type(exc).__name__}: {exc}"[:600]}
            break
        if out[mode].get("killed_by"):
            killed_in = mode
    return out


# ---------------------------------------------------------------------------------------------------------
# scoring

TRIVIAL_KINDS = ("timeout", "problem", "raised")
"""Kill kinds counted as trivially killed (no wrong value was needed to see the mutant is broken)."""


def survivor_class(after_killed: bool, probe: dict | None) -> str:
    """``killed``; for a survivor of ``after``: ``likely_equivalent`` (bit-identical to the fixture on the
    probe), ``wrong_on_probe`` (the guard's check rejects it on the probe batch), ``differs_but_passes``,
    or ``unprobed`` (no probe result, e.g. the probe's child failed: counted as non-equivalent)."""
    if after_killed:
        return "killed"
    if not probe or "bit_identical" not in probe:
        return "unprobed"
    if probe.get("wrong_cases"):
        return "wrong_on_probe"
    return "likely_equivalent" if probe["bit_identical"] else "differs_but_passes"


def score(records: list[dict], mode: str) -> dict[str, Any]:
    """Kill fractions of one mode over non-equivalent mutants.

    Args:
        records: per mutant ``{"class": survivor_class(...) or "not_run" (left out), mode: {"killed_by": guard|None,
            "kill_kind": "problem"|"raised"|"wrong"|"guard_error"|None}}``.
        mode: ``before`` or ``after``.

    Returns:
        Counts (``mutants``, ``likely_equivalent``, ``non_equivalent``, ``killed``, ``killed_by`` per guard,
        ``trivially_killed``, ``survived``) and fractions: ``killed_fraction`` and ``by_guard`` (over
        non-equivalent mutants), ``killed_fraction_without_trivial`` and ``by_guard_without_trivial`` (trivially
        killed mutants left out of numerator and denominator); ``None`` where the denominator is 0.
    """
    records = [r for r in records if r["class"] != "not_run"]
    equivalent = [r for r in records if r["class"] == "likely_equivalent"]
    nonequiv = [r for r in records if r["class"] != "likely_equivalent"]
    killed = [r for r in nonequiv if r[mode].get("killed_by")]
    trivial = [r for r in killed if r[mode].get("kill_kind") in TRIVIAL_KINDS]
    by_guard: dict[str, int] = {}
    by_guard_nt: dict[str, int] = {}
    for r in killed:
        g = r[mode]["killed_by"]
        by_guard[g] = by_guard.get(g, 0) + 1
        if r not in trivial:
            by_guard_nt[g] = by_guard_nt.get(g, 0) + 1
    n, n_nt = len(nonequiv), len(nonequiv) - len(trivial)

    def frac(a: int, b: int) -> float | None:
        return round(a / b, 4) if b else None

    return {
        "mutants": len(records), "likely_equivalent": len(equivalent), "non_equivalent": n,
        "killed": len(killed), "trivially_killed": len(trivial), "survived": n - len(killed),
        "killed_by": dict(sorted(by_guard.items())),
        "killed_fraction": frac(len(killed), n),
        "by_guard": {g: frac(k, n) for g, k in sorted(by_guard.items())},
        "killed_fraction_without_trivial": frac(len(killed) - len(trivial), n_nt),
        "by_guard_without_trivial": {g: frac(k, n_nt) for g, k in sorted(by_guard_nt.items())},
    }


# ---------------------------------------------------------------------------------------------------------
# driver

def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("MUTATION_STUDY_COMMIT")


def environment(args) -> dict[str, Any]:
    """Machine, cores, versions, commit and the study's settings."""
    from workbench import env as envmod

    env = envmod.collect("cpu")
    env.update(machine_label=args.machine, hostname=platform.node(), cores=os.cpu_count(),
               commit=_git_commit() or os.environ.get("MUTATION_STUDY_COMMIT"),
               commit_note=os.environ.get("MUTATION_STUDY_COMMIT_NOTE"))
    return env


def _run_jobs(jobs: list[JudgeJob], n: int, budget_s: float | None = None, log: Path | None = None) -> list[dict]:
    """Run ``jobs`` on ``n`` worker processes (spawned: no torch state forked); results in completion order.

    Jobs not started within ``budget_s`` seconds are cancelled and come back as ``{"key", "not_run": ...}``
    (jobs already running finish). Each result (without probe digests) is also appended to ``log`` (JSON
    lines, ``mutation_study_records.jsonl``: what a run cut short still leaves) as it arrives.
    """
    out: list[dict] = []
    t0 = time.monotonic()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=n, mp_context=ctx) as pool:
        futs = {pool.submit(judge, j): j for j in jobs}
        pending = set(futs)
        cancelled = False
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=5, return_when=concurrent.futures.FIRST_COMPLETED)
            if budget_s is not None and not cancelled and time.monotonic() - t0 > budget_s:
                cancelled = True
                for f in pending:
                    f.cancel()
            for f in done:
                j = futs[f]
                if f.cancelled():
                    rec = {"key": j.key, "not_run": f"not started within --budget-s {budget_s}"}
                else:
                    try:
                        rec = f.result()
                    except Exception as exc:  # a worker died: recorded, never hidden
                        rec = {"key": j.key, "error": f"{type(exc).__name__}: {exc}"[:600]}
                out.append(rec)
                if log is not None:
                    with log.open("a") as fh:
                        slim = {k: ({kk: vv for kk, vv in v.items() if kk != "digests"} if isinstance(v, dict) else v)
                                for k, v in rec.items()}  # the probe's digests stay in memory only
                        fh.write(json.dumps(slim, default=str) + "\n")
                steps = []
                for md in j.modes:
                    r = rec.get(md)
                    if r is None:
                        continue
                    what = r.get("error") or r.get("killed_by") or r.get("status") or (
                        f"{r.get('wrong_cases')} wrong" if md == "probe" else "survived")
                    steps.append(f"{md} {what} {r.get('wall_s', 0)}s" + (" (inferred)" if "inferred_from" in r else ""))
                print(f"[{len(out)}/{len(jobs)} {time.monotonic() - t0:6.1f}s] {j.key}: "
                      f"{'; '.join(steps) or rec.get('not_run') or rec.get('error')}", flush=True)
    return out


def run_study(args) -> dict[str, Any]:
    """Generate, judge, probe and score; returns the result document."""
    started = time.time()
    t_start = time.monotonic()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    records: dict[str, dict] = {}
    populations: dict[str, int] = {}
    jobs: list[JudgeJob] = []
    common = dict(seed=args.seed, child_timeout_s=args.child_timeout, probe_draws=args.probe_draws,
                  probe_seed=args.seed + 1, deadline=None if args.budget_s is None else started + args.budget_s)
    for task_id in tasks:
        fx = fixture_dir(task_id)
        chosen, populations[task_id] = sample_mutants(task_id, fx, args.max_mutants, args.seed)
        for m in chosen:
            key = f"{task_id}#{m.path}#{m.index}"
            records[key] = {"key": key, "task": task_id, "fixture": str(fx.relative_to(REPO_ROOT)), **m.to_dict()}
            jobs.append(JudgeJob(key=key, task_id=task_id, files={m.path: m.source}, chain=not args.full_after, **common))
        # the unmutated fixture: must pass both modes (else the study is void); its probe is the reference bits
        base_key = f"{task_id}#fixture"
        records[base_key] = {"key": base_key, "task": task_id, "fixture": str(fx.relative_to(REPO_ROOT))}
        jobs.append(JudgeJob(key=base_key, task_id=task_id, files={}, chain=False, **common))
    # fixtures first, then the tasks round-robin (the distributed task's ranks spread over the run)
    by_task = [[j for j in jobs if j.task_id == t] for t in tasks]
    fixtures = [j for g in by_task for j in g if j.key.endswith("#fixture")]
    rest = [g[i] for i in range(max(map(len, by_task), default=0)) for g in
            [[j for j in g if not j.key.endswith("#fixture")] for g in by_task] if i < len(g)]
    jobs = fixtures + rest
    log = args.out_dir / "mutation_study_records.jsonl"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)
    for rec in _run_jobs(jobs, args.jobs, None if args.budget_s is None else args.budget_s - (time.time() - started),
                         log):
        records[rec["key"]].update({k: v for k, v in rec.items() if k != "key"})
    per_task = {}
    for task_id in tasks:
        base = records[f"{task_id}#fixture"]
        base_digests = (base.get("probe") or {}).pop("digests", None)
        muts = [r for k, r in records.items() if r["task"] == task_id and not k.endswith("#fixture")]
        for r in muts:
            for md in ("before", "after"):
                r.setdefault(md, {"killed_by": None, "kill_kind": None, "error": r.get("error") or r.get("not_run")
                                  or "no result"})
            pr = r.get("probe")
            if pr is not None and "digests" in pr:
                digests = pr.pop("digests")
                if base_digests is not None:
                    pr["bit_identical"], diff = same_probe(base_digests, digests)
                    pr["first_difference"] = diff or None
            r["class"] = ("not_run" if any("error" in r[md] for md in ("before", "after"))
                          else survivor_class(bool(r["after"].get("killed_by")), pr))
        base_ok = all((base.get(md) or {}).get("verdicts") and not (base.get(md) or {}).get("killed_by")
                      for md in ("before", "after"))
        per_task[task_id] = {
            "fixture": base["fixture"], "population": populations[task_id], "sampled": len(muts),
            "fixture_accepted_both_modes": base_ok,
            "fixture_verdicts": {md: (base.get(md) or {}).get("verdicts") for md in ("before", "after")},
            "fixture_wall_s": {md: (base.get(md) or {}).get("wall_s") for md in ("before", "after", "probe")},
            "fixture_probe": {k: v for k, v in (base.get("probe") or {}).items()
                              if k in ("probe_cases", "wrong_cases", "status", "summary", "error")},
            "before": score(muts, "before"), "after": score(muts, "after"),
            "after_inferred_from_before": sum("inferred_from" in r["after"] for r in muts),
            "classes": {c: sum(r["class"] == c for r in muts) for c in
                        ("killed", "likely_equivalent", "differs_but_passes", "wrong_on_probe", "unprobed",
                         "not_run")},
            "kill_kinds_after": {k: sum(r["after"].get("kill_kind") == k for r in muts)
                                 for k in ("wrong", "raised", "problem", "timeout", "guard_error")},
            "not_run": [f"{r['key']}: {r['after'].get('error') or r['before'].get('error')}" for r in muts
                        if r["class"] == "not_run"],
            "probe_errors": [r["key"] for r in muts if "error" in (r.get("probe") or {})],
        }
    mutants = [r for k, r in records.items() if not k.endswith("#fixture")]
    valid = all(p["fixture_accepted_both_modes"] and not p["fixture_probe"].get("wrong_cases")
                and "status" not in p["fixture_probe"] and "error" not in p["fixture_probe"] for p in per_task.values())
    return {
        "valid": valid,
        "validity": "every unmutated fixture passed correctness and activation in both modes and its probe"
                    if valid else "VOID: an unmutated fixture failed a mode or its probe (see per_task.fixture_*)",
        "what": "mutation study of each task's good CPU fixture: fraction of non-equivalent mutants each guard kills, "
                "before (fixed workloads only) and after (fixed workloads + run-time random domain draws)",
        "command": "python bench/mutation_study.py " + " ".join(sys.argv[1:]),
        "settings": {"tasks": tasks, "max_mutants": args.max_mutants, "seed": args.seed, "jobs": args.jobs,
                     "probe_draws": args.probe_draws, "probe_seed": args.seed + 1,
                     "child_timeout_s": args.child_timeout, "budget_s": args.budget_s, "device": "cpu", "guards": ["correctness", "activation"],
                     "after_of_before_kills": "judged" if args.full_after else
                     "inferred (same seed: the fixed configurations and their inputs are the same in both modes)",
                     "shrinking": "skipped (report-only; never changes a verdict)"},
        "environment": environment(args),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "wall_s": round(time.monotonic() - t_start, 1),
        "per_task": per_task,
        "survivors": [{k: r.get(k) for k in ("key", "task", "path", "line", "col", "operator", "original",
                                              "replacement", "class")} | {"probe": r.get("probe")}
                      for r in mutants if r["class"] not in ("killed", "not_run")],
        "mutants": mutants,
    }


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def markdown(doc: dict) -> str:
    """The short table of a result document."""
    s, env = doc["settings"], doc["environment"]
    lines = [
        "# Mutation study (issue 19 item 5)", "",
        f"Machine `{env.get('machine_label')}` ({env.get('cores')} cores), torch {env.get('torch')}, commit "
        f"`{(env.get('commit') or '?')[:12]}`, seed {s['seed']}, at most {s['max_mutants']} mutants per task, "
        f"{s['jobs']} jobs, probe {s['probe_draws']} draws, child time limit {s['child_timeout_s']} s, device cpu; "
        f"wall {doc['wall_s']} s. Command: `{doc['command']}`.", "",
        f"Validity: {doc['validity']}.", "",
        "Before: fixed workloads only. After: fixed workloads + the task's run-time random domain draws (same seed). "
        "Fractions are over non-equivalent mutants (likely-equivalent survivors left out); 'w/o trivial' leaves out "
        "mutants killed only by crashes, raising calls or timeouts.", "",
        "| task | sampled / population | likely equiv. | non-equiv. | correctness before | correctness after | "
        "activation after | killed after | w/o trivial after | survivors (non-equiv.) | not run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t, p in doc["per_task"].items():
        b, a = p["before"], p["after"]
        lines.append(
            f"| {t} | {p['sampled']} / {p['population']} | {a['likely_equivalent']} | {a['non_equivalent']} | "
            f"{_pct(b['by_guard'].get('correctness', 0.0 if b['non_equivalent'] else None))} | "
            f"{_pct(a['by_guard'].get('correctness', 0.0 if a['non_equivalent'] else None))} | "
            f"{_pct(a['by_guard'].get('activation', 0.0 if a['non_equivalent'] else None))} | "
            f"{_pct(a['killed_fraction'])} | {_pct(a['killed_fraction_without_trivial'])} | {a['survived']} | "
            f"{p['classes']['not_run']} |")
    lines += ["", "## Survivors of 'after'", "", "| task | where | rewrite | class | probe |", "|---|---|---|---|---|"]
    for r in doc["survivors"]:
        pr = r.get("probe") or {}
        note = pr.get("first_wrong") or pr.get("first_difference") or pr.get("summary") or ""
        lines.append(f"| {r['task']} | {r['path']}:{r['line']}:{r['col']} | `{r['original']}` -> `{r['replacement']}` "
                     f"({r['operator']}) | {r['class']} | {str(note).replace('|', '/')[:160]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="comma-separated task ids")
    p.add_argument("--max-mutants", type=int, default=40, help="mutants per task at most (seeded sample)")
    p.add_argument("--seed", type=int, default=19, help="sampling seed and the correctness run-time seed")
    p.add_argument("--jobs", type=int, default=1, help="judgings at a time (processes)")
    p.add_argument("--probe-draws", type=int, default=64, help="random domain configurations of the equivalence probe")
    p.add_argument("--child-timeout", type=float, default=120.0, help="correctness child time limit (s) in the study")
    p.add_argument("--full-after", action="store_true",
                   help="judge 'after' for mutants 'before' killed too (default: inferred, the same fixed cases)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no judging, probe or job after this many seconds from the start (recorded as not run)")
    p.add_argument("--machine", default=platform.node() or "unknown", help="machine label recorded in the result")
    p.add_argument("--out-dir", type=Path, required=True, help="writes mutation_study.json and .md there")
    args = p.parse_args(argv)
    if args.max_mutants < 0 or args.jobs < 1 or not 0 < args.probe_draws <= 256 or args.child_timeout <= 0:
        p.error("--max-mutants >= 0, --jobs >= 1, 0 < --probe-draws <= 256 and --child-timeout > 0 are required")
    unknown = [t for t in args.tasks.split(",") if t.strip() and t.strip() not in GOOD_CPU_FIXTURE]
    if unknown:
        p.error(f"no good CPU fixture known for {unknown}; known: {sorted(GOOD_CPU_FIXTURE)}")
    doc = run_study(args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "mutation_study.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
    (args.out_dir / "mutation_study.md").write_text(markdown(doc))
    print(markdown(doc))
    if not doc["valid"]:
        print(doc["validity"], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
