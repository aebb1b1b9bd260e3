"""No luck by retrying: every judging of the same candidate content is pooled with the earlier ones.

A candidate is identified by its **content key**: the task spec, the base commit, the device, the
guards run, and each changed file's content, where a Python file counts by its syntax tree with docstrings removed (so a
comment, whitespace or docstring edit is the same candidate). Each judging appends one line to
``.workbench/judgings.jsonl``. When a key was judged before:

- a guard that found the candidate wrong before (a FAIL of isolation, audit, correctness, activation
  or model_eval; their inputs are fresh each time, so a failure is evidence about the kernel) fails it
  again, naming the earlier result: a later lucky draw does not erase a found bug (when this judging
  found it wrong too, at that guard or an earlier one, its own finding leads the summary);
- the perf guard's configurations are re-classified on the pooled pairs of every judging (the same
  paired statistics, more pairs), so k attempts do not give k chances at a noisy gain.

A FAIL whose cause may be the environment (an ERROR, a child that did not complete: crashed, killed at
its time limit) is not carried over, nor are perf timings other than plain gain/no-gain/regression.

Source: issue 20 item 3 ("its verdict pools the evidence of every judging of that tree").
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

from guards.perf_status import PerfStatus
from guards.verdict import Evidence, Status, Verdict

logger = logging.getLogger("workbench.retries")

LEDGER_FILE = "judgings.jsonl"
"""Under ``.workbench/``: one JSON line per judging (content key, device, result file, verdict)."""

CARRIED_GUARDS = ("isolation", "audit", "correctness", "activation", "model_eval")
"""Guards whose FAIL on an earlier judging of the same content fails every later judging of it."""

POOLED_PERF_VERDICTS = tuple(s.value for s in PerfStatus if s.timing_only)
"""Per-configuration verdicts decided by the timings alone (``PerfStatus.timing_only``); only their pairs are pooled."""


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return tree


def normalized_content(path: str, data: bytes | None) -> str:
    """What counts of one changed file: a Python file's syntax tree without docstrings (comments,
    whitespace and docstrings do not count), else a hash of the bytes; ``deleted`` for a removed file."""
    if data is None:
        return "deleted"
    if path.endswith(".py"):
        try:
            return "ast:" + ast.dump(_strip_docstrings(ast.parse(data)), include_attributes=False)
        except (SyntaxError, ValueError):
            pass
    return "bytes:" + hashlib.sha256(data).hexdigest()


def content_key(repo_root: Path, task, base_commit: str, candidate_commit: str, device: str,
                guards: tuple[str, ...] = ()) -> str:
    """The content key of a committed candidate (hex SHA-256).

    Args:
        repo_root: a checkout that holds both commits.
        task: the task spec as judged (its whole content counts: a changed tolerance is another judging).
        base_commit, candidate_commit: full SHAs.
        device: ``cpu`` or ``cuda``.
        guards: names of the guards run (another set of guards is another judging).
    """
    import git

    repo = git.Repo(repo_root)
    base, cand = repo.commit(base_commit), repo.commit(candidate_commit)
    spec = hashlib.sha256(task.model_dump_json().encode()).hexdigest()
    h = hashlib.sha256(f"{task.task_id}\0{spec}\0{base.hexsha}\0{device}\0{','.join(guards)}\0".encode())
    for d in sorted(base.diff(cand), key=lambda d: d.b_path or d.a_path):
        path = d.b_path or d.a_path
        blob = None if d.deleted_file else d.b_blob.data_stream.read()
        h.update(f"{path}\0{normalized_content(path, blob)}\0".encode())
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Judging:
    """One line of the ledger.

    Attributes:
        key: the content key.
        result_id, result_path: the result file it wrote.
        accepted: its verdict.
        failed_guard: the guard of its first FAIL ('' when none).
    """

    key: str
    result_id: str
    result_path: str
    accepted: bool
    failed_guard: str


def ledger_path(state: Path) -> Path:
    """The ledger: ``WORKBENCH_JUDGINGS`` when set, else ``state / LEDGER_FILE`` (``state``: ``.workbench``)."""
    from workbench import envs

    return envs.JUDGINGS.read() or state / LEDGER_FILE


def earlier_judgings(state: Path, key: str) -> list[Judging]:
    """Every recorded judging of ``key`` (``state``: the ``.workbench`` folder), oldest first; lines that
    do not parse are skipped and logged (a killed writer leaves at most one partial line)."""
    path = ledger_path(state)
    out = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for i, line in enumerate(lines, 1):
        try:
            d = json.loads(line)
            if d.get("key") == key:
                out.append(Judging(key=d["key"], result_id=d["result_id"], result_path=d["result_path"],
                                   accepted=bool(d["accepted"]), failed_guard=str(d.get("failed_guard", ""))))
        except (ValueError, KeyError, TypeError, AttributeError):
            logger.warning("%s line %d is not a judging record; skipped", path, i)
    return out


def record_judging(state: Path, j: Judging) -> None:
    """Append ``j`` to the ledger (one ``write`` of one line in append mode: concurrent runs do not
    interleave their lines)."""
    path = ledger_path(state)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(dataclasses.asdict(j), sort_keys=True) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@dataclasses.dataclass
class Pooled:
    """The current judging's verdicts and perf entries after pooling with the earlier ones.

    Attributes:
        verdicts: the pipeline's verdicts, a carried FAIL or the pooled perf verdict in place.
        perf: per-configuration perf entries (dicts of ``PerfResult`` fields), pooled where possible.
        judging: 1-based number of this judging of the content (1: first).
        pooled_from: result ids of the earlier judgings whose evidence counts.
    """

    verdicts: list[Verdict]
    perf: list[dict]
    judging: int
    pooled_from: list[str]


def pool(task, verdicts: list[Verdict], perf: list[dict], earlier: list[Judging], *, device: str,
         seed: int = 0) -> Pooled:
    """Pool the current judging (``verdicts``, ``perf``) with ``earlier`` judgings of the same content.

    Args:
        task: the task spec (perf thresholds).
        verdicts: this judging's verdicts, in pipeline order.
        perf: this judging's perf entries (``ctx.artifacts.perf``).
        earlier: :func:`earlier_judgings` of its key.
        device: ``cpu`` or ``cuda`` (the regression test's calibrated thresholds).
        seed: bootstrap seed of the pooled intervals.

    Returns:
        :class:`Pooled`; unchanged (``judging`` 1) without earlier judgings.
    """
    from guards.perf import classify, perf_verdict
    from workbench.results import read_result

    if not earlier:
        return Pooled(list(verdicts), list(perf), 1, [])
    verdicts = list(verdicts)
    olds = []
    for j in earlier:
        try:
            olds.append(read_result(Path(j.result_path)))
        except Exception as exc:  # a removed or unreadable result: the ledger line still counts as a judging
            logger.warning("earlier judging %s: result %s unreadable (%s); its evidence is not pooled",
                           j.result_id, j.result_path, exc)
    n = len(earlier) + 1
    ids = [j.result_id for j in earlier]
    carried = next(((o, v) for o in olds for v in o.verdicts
                    if v.guard in CARRIED_GUARDS and v.status is Status.FAIL
                    and not any(e.name == "child_problem" for e in v.evidence)), None)
    if carried is not None:
        o, v = carried
        names = [x.guard for x in verdicts]
        i = names.index(v.guard) if v.guard in names else len(verdicts)
        own = next((x for x in verdicts[:i + 1] if x.guard in CARRIED_GUARDS and x.status is Status.FAIL), None)
        if own is not None:  # this judging found it wrong too, at the same guard or earlier: its own words first
            i = names.index(own.guard)
            fail = own.model_copy(update={
                "summary": f"{own.summary.rstrip('.')}. (This exact code was judged before, this is judging {n} of it; "
                           f"judging {o.result_id} (seed {o.seed}) found it wrong too, at {v.guard}.)",
                "evidence": (*own.evidence, Evidence(name="earlier_result", value=o.result_id),
                             Evidence(name="judging", value=n, unit="count"))})
        else:
            fail = Verdict(guard=v.guard, status=Status.FAIL,
                           summary=f"This exact code was judged before (this is judging {n} of it): judging {o.result_id} "
                                   f"(seed {o.seed}) found it wrong, and a later draw does not undo that: {v.summary}",
                           evidence=(Evidence(name="earlier_result", value=o.result_id),
                                     Evidence(name="judging", value=n, unit="count"), *v.evidence[:8]))
        out = verdicts[:i] + [fail] + [
            Verdict(guard=x.guard, status=Status.SKIP, summary=f"Not run: {v.guard} did not pass.")
            for x in verdicts[i + 1:]]
        return Pooled(out, list(perf), n, ids)
    pv = next((v for v in verdicts if v.guard == "perf"), None)
    if pv is None or pv.status not in (Status.PASS, Status.FAIL) or not perf:
        return Pooled(verdicts, list(perf), n, ids)
    if any(r["verdict"] not in POOLED_PERF_VERDICTS for r in perf):
        return Pooled(verdicts, list(perf), n, ids)  # a non-timing failure decides alone
    max_reg, alpha = task.perf.regression_test(device)
    pooled = []
    for idx, r in enumerate(perf):
        base, cand = list(r["baseline_us"]), list(r["candidate_us"])
        used = 0
        for o in olds:
            for p in o.perf:
                if p.name == r["name"] and p.verdict in POOLED_PERF_VERDICTS and \
                        p.baseline_implementation == r.get("baseline_implementation", "standard"):
                    base += list(p.baseline_us)
                    cand += list(p.candidate_us)
                    used += 1
        if not used:
            pooled.append(r)
            continue
        claimed = PerfStatus(r["verdict"]).claimed
        st = classify(base, cand, claimed=claimed, max_regression_pct=max_reg, min_speedup=task.perf.min_speedup,
                      confidence=task.perf.confidence, alpha=alpha, seed=seed + idx)
        pooled.append({**r, "baseline_us": tuple(base), "candidate_us": tuple(cand),
                       "baseline_median_us": st["baseline_median_us"], "candidate_median_us": st["candidate_median_us"],
                       "speedup": st["speedup"], "speedup_ci": st["speedup_ci"], "p_slower": st["p_slower"],
                       "verdict": st["verdict"], "pooled_judgings": used + 1})
    new = perf_verdict(task, pooled, [r["name"] for r in pooled])
    new = new.model_copy(update={
        "summary": f"Pooled over {n} judgings of this exact code (the timings of earlier ones included): {new.summary}",
        "evidence": (Evidence(name="judging", value=n, unit="count"),
                     *(Evidence(name="earlier_result", value=i) for i in ids), *new.evidence)})
    verdicts = [new.with_duration(pv.duration_s) if v is pv else v for v in verdicts]
    return Pooled(verdicts, pooled, n, ids)
