"""The pool's surface: parse ``--pool``, the :class:`Pool` protocol, the local pool, the progress board.

A pool runs the guards phase of a judging (:func:`workbench.pipeline.run_guards_phase`); the caller writes
the result file (:func:`workbench.pipeline.judge_candidate`). ``local`` judges in this process, one verdict
at a time (concurrent agent runs wait for it, so two perf timings never share the machine);
``ray://HOST:PORT`` submits each verdict as a Ray task (:mod:`workbench.pool.ray_pool`).

Progress: every pool keeps a board, ``.workbench/pool/<host>-<pid>.json``, with each verdict's state
(queued, running, done, error), node, tries and times; ``workbench pool status`` and the review UI's
``/pool`` page read these files.

Source: issue 16 items 1 and 3.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from guards.base import Guard
from guards.verdict import Status, Verdict
from workbench.errors import WorkbenchError
from workbench.results import now_utc

logger = logging.getLogger("workbench.pool")

STATES = ("queued", "running", "done", "error")
"""A verdict's states on the board, in order (``error``: the pool gave it an ERROR verdict)."""


class PoolError(WorkbenchError):
    """The pool cannot be used as asked (bad ``--pool``, unreachable cluster, a device no node has)."""


class Pool(Protocol):
    """Where the guards phase of a judging runs."""

    spec: str

    def detect_device(self, requested: str | None) -> str:
        """``cpu`` or ``cuda`` for ``requested`` (``auto``/``None``: what the pool's machines have).

        Raises:
            ValueError: an unknown device, or ``cuda`` where the pool has none.
        """

    def run_guards(self, repo_root: Path, task, cand, *, device: str, seed: int, guards: Sequence[Guard],
                   label: str):
        """Run ``guards`` on the committed candidate ``cand``; return a :class:`workbench.pipeline.GuardsPhase`.

        A worker that died or refused the verdict gives an ERROR verdict of guard ``pool`` (data, not an
        exception). ``label`` names the verdict on the board (the result id).

        Raises:
            PoolError: the verdict cannot be submitted (e.g. no node has the device it needs).
        """

    def close(self) -> None:
        """Cancel what is still queued or running and disconnect."""


@dataclasses.dataclass
class BoardEntry:
    """One verdict on the board.

    Attributes:
        state: one of :data:`STATES`.
        node: where it runs or ran (empty while queued).
        pid: the worker's process id (0 while queued).
        tries: times a worker started it.
        queued_at, updated_at: UTC ISO 8601.
        note: the reason of an ``error``, or the result's outcome.
    """

    state: str
    node: str = ""
    pid: int = 0
    tries: int = 0
    queued_at: str = ""
    updated_at: str = ""
    note: str = ""


class Board:
    """The progress of one process's pool, mirrored to ``<state_dir>/pool/<host>-<pid>.json``.

    Args:
        spec: the pool (``local`` or ``ray://HOST:PORT``), recorded in the file.
        on_change: called with ``(label, entry)`` after every change (the CLI prints a line).
    """

    def __init__(self, spec: str, on_change: Callable[[str, BoardEntry], None] | None = None) -> None:
        self.spec = spec
        self.on_change = on_change
        self.entries: dict[str, BoardEntry] = {}
        self._lock = threading.Lock()
        self._paths: set[Path] = set()

    def update(self, repo_root: Path | None, label: str, state: str, **fields) -> BoardEntry:
        """Set ``label``'s state (and any :class:`BoardEntry` fields); write the file under ``repo_root``.

        Raises:
            ValueError: ``state`` is not one of :data:`STATES`.
        """
        if state not in STATES:
            raise ValueError(f"pool board: state {state!r}: expected one of {', '.join(STATES)}.")
        with self._lock:
            now = now_utc()
            old = self.entries.get(label)
            entry = dataclasses.replace(old or BoardEntry(state=state, queued_at=now), state=state, updated_at=now,
                                        **fields)
            changed = old is None or (old.state, old.node, old.pid, old.tries) != (entry.state, entry.node, entry.pid,
                                                                                   entry.tries)
            self.entries[label] = entry
            if repo_root is not None:
                self._write(board_path(repo_root))
        if changed and self.on_change is not None:
            self.on_change(label, entry)
        return entry

    def _write(self, path: Path) -> None:
        self._paths.add(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {"pool": self.spec, "pid": os.getpid(), "host": socket.gethostname(), "updated_at": now_utc(),
                "verdicts": {k: dataclasses.asdict(v) for k, v in self.entries.items()}}
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(data, indent=2), encoding="utf-8")
        tmp.replace(path)


def board_path(repo_root: Path) -> Path:
    """This process's board file: ``<repo_root>/.workbench/pool/<host>-<pid>.json``."""
    from workbench.worktree import state_dir

    return state_dir(Path(repo_root)) / "pool" / f"{socket.gethostname()}-{os.getpid()}.json"


def read_boards(repo_root: Path) -> list[dict]:
    """Every board file under ``<repo_root>/.workbench/pool/``, newest first (unreadable ones skipped)."""
    from workbench.worktree import state_dir

    boards = []
    for p in sorted((state_dir(Path(repo_root)) / "pool").glob("*.json")):
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        data["path"] = str(p)
        boards.append(data)
    return sorted(boards, key=lambda b: b.get("updated_at", ""), reverse=True)


def error_phase(guards: Sequence[Guard], reason: str, environment: dict):
    """The guards phase of a verdict the pool could not judge: an ERROR verdict of guard ``pool`` with
    ``reason``, every guard SKIP."""
    from workbench.pipeline import GuardsPhase

    verdicts = [Verdict(guard="pool", status=Status.ERROR, summary=reason)]
    verdicts += [Verdict(guard=g.name, status=Status.SKIP, summary="Not run: the pool could not judge this "
                         "candidate (see the pool verdict).") for g in guards]
    return GuardsPhase(verdicts=verdicts, changed_paths=[], cases=[], perf=[], trace=[], environment=environment)


class LocalPool:
    """Judges in this process, one verdict at a time (today's behaviour, plus the board).

    Args:
        on_change: the board's callback (see :class:`Board`).
    """

    spec = "local"

    def __init__(self, on_change: Callable[[str, BoardEntry], None] | None = None) -> None:
        self.board = Board(self.spec, on_change)
        self._one_at_a_time = threading.Lock()

    def detect_device(self, requested: str | None) -> str:
        """:func:`workbench.pipeline.detect_device` (this machine's devices)."""
        from workbench.pipeline import detect_device

        return detect_device(requested)

    def run_guards(self, repo_root: Path, task, cand, *, device: str, seed: int, guards: Sequence[Guard],
                   label: str):
        """:func:`workbench.pipeline.run_guards_phase` here, once no other verdict of this pool runs."""
        from workbench.pipeline import run_guards_phase

        self.board.update(repo_root, label, "queued")
        with self._one_at_a_time:
            self.board.update(repo_root, label, "running", node=socket.gethostname(), pid=os.getpid(), tries=1)
            try:
                phase = run_guards_phase(repo_root, task, cand, device=device, seed=seed, guards=guards)
            except BaseException as exc:
                self.board.update(repo_root, label, "error", note=f"{type(exc).__name__}: {exc}")
                raise
        self.board.update(repo_root, label, "done", note=_outcome(phase))
        return phase

    def close(self) -> None:
        """Nothing to release."""


def _outcome(phase) -> str:
    bad = next((v for v in phase.verdicts if v.status in (Status.FAIL, Status.ERROR)), None)
    return f"{bad.guard} {bad.status.value}" if bad else "no guard failed"


def open_pool(spec: str | None, *, on_change: Callable[[str, BoardEntry], None] | None = None) -> Pool:
    """The pool ``spec`` names: ``local`` (or ``None``/empty) or ``ray://HOST:PORT`` (a Ray Client address).

    Raises:
        PoolError: ``spec`` is neither; the Ray extra is not installed; nothing listens at HOST:PORT; Ray
            cannot connect.
    """
    text = (spec or "local").strip()
    if text == "local":
        return LocalPool(on_change)
    if text.startswith("ray://"):
        from workbench.pool.ray_pool import RayPool

        return RayPool(text, on_change=on_change)
    raise PoolError(f"--pool {text!r}: expected local or ray://HOST:PORT (the Ray Client address of a cluster's "
                    "head, port 10001 by default); give one of those.")


def check_parallel(parallel: int) -> int:
    """``--parallel`` as given.

    Raises:
        PoolError: ``parallel`` < 1.
    """
    if parallel < 1:
        raise PoolError(f"--parallel {parallel}: expected the number of agent runs at once, at least 1; "
                        "got less. Use --parallel 1 for one run.")
    return parallel
