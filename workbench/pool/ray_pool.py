"""The Ray pool: each verdict's guards phase is one Ray task, on a worker that has the device it needs.

The worktree travels as a commit: a git bundle of the candidate commit and its base (the project's
history up to them; a few MB) goes with the task, the worker clones it into a temporary folder and runs
the same guards there (:func:`workbench.pipeline.run_guards_phase`, the worker's installed workbench). The
guards phase comes back as data and the caller writes the result file, so a verdict re-run by Ray (its
worker died) still writes exactly one result file.

Resources: one CPU per verdict on CPU; on CUDA also ``num_gpus`` = the task's largest world size
(``scope.tp_sizes``), and a Ray task's resources always come from one node, so one candidate's ranks stay
on one node (one GPU per rank, NCCL within the node). A worker whose torch sees fewer CUDA devices than
that refuses the verdict (:class:`DeviceRefused`), which becomes an ERROR verdict naming the node.

Faults: a worker that dies mid-verdict is re-run by Ray up to ``WORKBENCH_POOL_MAX_RETRIES`` times
(Ray's own ``max_retries``: system failures only, never an exception of the guards); past that the
verdict is an ERROR of guard ``pool`` with Ray's reason. The guards' own children of a killed worker are
not in its process group and end at their own time limits.

Source: Ray docs, "Fault tolerance: tasks" (``max_retries``) and "Resources" (a task's resources come from
one node); issue 16 items 1 and 3.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from guards.base import Guard
from workbench import envs
from workbench.pool.base import Board, BoardEntry, PoolError, _outcome, error_phase

logger = logging.getLogger("workbench.pool.ray")

CONNECT_TIMEOUT_S = 5.0
"""How long a TCP connect to the Ray Client port may take before the pool is called unreachable (seconds).
Source: a local connect answers in well under 1 ms; 5 s covers a remote head across a slow network."""
CONNECT_ATTEMPTS = 6
CONNECT_BACKOFF_S = 2.0
"""Ray Client connects tried (count) and the wait before the next (seconds, doubled each time) when the
server answers "Initialization failure from server" (ConnectionAbortedError): the head starts a server
process per client and on a busy machine that start can outlast the first handshake (seen on the 2-core
CI machine under the test suite's load, 2026-12-03). Any other error is final at once."""
CONNECT_BACKOFF_MAX_S = 16.0
"""Longest wait between two connects (seconds): 2+4+8+16+16 s in all before the last try. Three tries
(6 s) were not enough for a head busy with CI's suite (session 12's CI: aborted 3 times)."""
POLL_S = 0.5
"""How often the caller checks a submitted verdict's progress (seconds)."""


class DeviceRefused(RuntimeError):
    """A worker lacks the device a verdict needs (e.g. torch sees fewer CUDA devices than the world size)."""


@dataclasses.dataclass(frozen=True)
class JudgeRequest:
    """One verdict for a worker (pickled by Ray).

    Attributes:
        label: the verdict's name (the result id).
        task_id: the task.
        bundle: ``git bundle`` bytes holding ``candidate_commit`` and ``base_commit``.
        source, kind, branch, base_commit, candidate_commit: the candidate (:class:`workbench.worktree.Candidate`).
        device: ``cpu`` or ``cuda``.
        world_size: CUDA devices the verdict needs on its node (count).
        seed: the run-time seed.
        guards: the guards, in order.
    """

    label: str
    task_id: str
    bundle: bytes
    source: str
    kind: str
    branch: str
    base_commit: str
    candidate_commit: str
    device: str
    world_size: int
    seed: int
    guards: tuple[Guard, ...]


def world_size_of(task) -> int:
    """GPUs one verdict of ``task`` needs on one node: its largest TP size (1 without a [distributed] table)."""
    return max(task.scope.tp_sizes) if getattr(task, "distributed", None) is not None else 1


def resources_for(task, device: str) -> dict[str, float]:
    """Ray task options for a verdict of ``task`` on ``device``: ``num_cpus`` 1, plus ``num_gpus`` = world
    size on ``cuda``. Source: issue 16 item 1."""
    return {"num_cpus": 1, "num_gpus": world_size_of(task)} if device == "cuda" else {"num_cpus": 1, "num_gpus": 0}


def make_bundle(repo_root: Path, cand, label: str) -> bytes:
    """A git bundle of ``cand``'s candidate and base commits, read from its worktree.

    Raises:
        PoolError: git could not write it (its message included).
    """
    wt = str(cand.worktree)
    refs = {f"refs/workbench-pool/{label}/candidate": cand.candidate_commit,
            f"refs/workbench-pool/{label}/base": cand.base_commit}
    with tempfile.TemporaryDirectory(prefix="workbench-bundle-") as tmp:
        out = Path(tmp) / "candidate.bundle"
        try:
            for ref, sha in refs.items():
                subprocess.run(["git", "-C", wt, "update-ref", ref, sha], check=True, capture_output=True, text=True)
            subprocess.run(["git", "-C", wt, "bundle", "create", "-q", str(out), *refs], check=True,
                           capture_output=True, text=True)
            return out.read_bytes()
        except subprocess.CalledProcessError as exc:
            raise PoolError(f"Pool: cannot bundle {cand.candidate_commit[:12]} from {wt}: {exc.stderr.strip()}; "
                            "check that the worktree's repository is readable.") from None
        finally:
            for ref in refs:
                subprocess.run(["git", "-C", wt, "update-ref", "-d", ref], capture_output=True)


def refuse_without_device(device: str, world_size: int, *, node: str, cuda_count: Callable[[], int] | None = None) -> None:
    """Refuse a verdict this machine cannot judge.

    Raises:
        DeviceRefused: ``device`` is ``cuda`` and fewer than ``world_size`` CUDA devices are visible.
    """
    if device != "cuda":
        return
    if cuda_count is None:
        import torch

        cuda_count = torch.cuda.device_count if torch.cuda.is_available() else (lambda: 0)
    seen = cuda_count()
    if seen < world_size:
        raise DeviceRefused(f"Pool worker on node {node} refuses the verdict: it needs {world_size} CUDA device(s) "
                            f"on one node, torch sees {seen} here; give the node a CUDA build of torch and its GPUs, "
                            "or judge with --device cpu.")


def judge_in_worker(request: JudgeRequest, started) -> object:
    """The Ray task's body: report the start, refuse a missing device, check out the bundle's base commit
    (the maintainer's side: task spec, reference, baseline) and the candidate in a worktree of it, run the
    guards phase.

    Args:
        request: the verdict.
        started: the pool's :class:`_Starts` actor handle (``None``: not reported).

    Returns:
        :class:`workbench.pipeline.GuardsPhase`.

    Raises:
        DeviceRefused: see :func:`refuse_without_device`.
        RuntimeError: the bundle did not unpack (git's message included).
    """
    import ray

    node = ray.util.get_node_ip_address()
    if started is not None:
        ray.get(started.started.remote(request.label, node, os.getpid()))
    refuse_without_device(request.device, request.world_size, node=node)
    from workbench.pipeline import run_guards_phase
    from workbench.taskspec import load_task
    from workbench.worktree import Candidate

    with tempfile.TemporaryDirectory(prefix="workbench-pool-") as tmp:
        # The maintainer's side (the task spec, its reference and inputs, the baseline) comes from the base
        # commit, as it comes from the maintainer's checkout in a local run; the candidate gets its own
        # worktree. A candidate that edits tasks/<id>/task.toml (its allowed paths) or reference.py is
        # judged by the base's spec, and the isolation guard sees those paths changed.
        bundle, repo, wt = Path(tmp) / "candidate.bundle", Path(tmp) / "repo", Path(tmp) / "candidate"
        bundle.write_bytes(request.bundle)
        for cmd in (["init", "-q", str(repo)],
                    ["-C", str(repo), "fetch", "-q", str(bundle), "refs/workbench-pool/*:refs/workbench-pool/*"],
                    ["-C", str(repo), "-c", "advice.detachedHead=false", "checkout", "-q", request.base_commit],
                    ["-C", str(repo), "worktree", "add", "-q", "--detach", str(wt), request.candidate_commit]):
            done = subprocess.run(["git", *cmd], capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(f"Pool worker on node {node}: git {' '.join(cmd[2:] if cmd[0] == '-C' else cmd)} "
                                   f"failed: {done.stderr.strip()}")
        cand = Candidate(source=request.source, kind=request.kind, branch=request.branch, worktree=wt,
                         base_commit=request.base_commit, candidate_commit=request.candidate_commit)
        return run_guards_phase(repo, load_task(repo, request.task_id), cand, device=request.device,
                                seed=request.seed, guards=request.guards)


class _Starts:
    """A Ray actor that counts each verdict's starts: ``label -> (node, pid, tries)``."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[str, int, int]] = {}

    def started(self, label: str, node: str, pid: int) -> None:
        tries = self.seen.get(label, ("", 0, 0))[2] + 1
        self.seen[label] = (node, pid, tries)

    def get(self, label: str) -> tuple[str, int, int] | None:
        return self.seen.get(label)


def _check_reachable(address: str) -> None:
    """Refuse an address nothing listens at, before Ray's own retries (tens of seconds).

    Raises:
        PoolError: malformed, or no TCP connection within :data:`CONNECT_TIMEOUT_S`.
    """
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise PoolError(f"--pool {address!r}: expected ray://HOST:PORT (e.g. ray://10.0.0.5:10001); got no port.")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise PoolError(f"--pool {address}: nothing answers at {host}:{port} ({exc.strerror or exc}); start the "
                        "cluster's head (`ray start --head`, Ray Client port 10001 by default) or fix the address."
                        ) from None


def _connect(ray, address: str):
    """``ray.init`` on ``address``, tried up to :data:`CONNECT_ATTEMPTS` times while the server aborts the
    handshake (ConnectionAbortedError), waiting :data:`CONNECT_BACKOFF_S` (doubled each time) between.

    Returns:
        Ray's client context.

    Raises:
        ConnectionAbortedError: the last attempt was aborted too; any other exception of ``ray.init`` at once.
    """
    for attempt in range(1, CONNECT_ATTEMPTS + 1):
        try:
            return ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except ConnectionAbortedError as exc:
            if attempt == CONNECT_ATTEMPTS:
                raise
            wait = min(CONNECT_BACKOFF_MAX_S, CONNECT_BACKOFF_S * 2 ** (attempt - 1))
            logger.warning("pool %s: Ray Client connect %d of %d aborted by the server (%s); retrying in %.0f s",
                           address, attempt, CONNECT_ATTEMPTS, str(exc).splitlines()[0] if str(exc) else "", wait)
            time.sleep(wait)
    raise AssertionError("unreachable: CONNECT_ATTEMPTS >= 1")


class RayPool:
    """Verdicts as Ray tasks on a cluster reached through Ray Client.

    Args:
        address: ``ray://HOST:PORT``.
        on_change: the board's callback (see :class:`workbench.pool.base.Board`).
        max_retries: Ray re-runs of a verdict whose worker died (default ``WORKBENCH_POOL_MAX_RETRIES``).

    Raises:
        PoolError: the ``pool`` extra is missing, or the cluster is unreachable.
    """

    def __init__(self, address: str, *, on_change: Callable[[str, BoardEntry], None] | None = None,
                 max_retries: int | None = None) -> None:
        self.spec = address
        self.board = Board(address, on_change)
        self.max_retries = envs.POOL_MAX_RETRIES.read() if max_retries is None else max_retries
        _check_reachable(address)
        try:
            import ray
        except ImportError:
            raise PoolError(f"--pool {address}: Ray is not installed here; install the pool extra "
                            "(pip install -e '.[pool]') or use --pool local.") from None
        self._ray = ray
        try:
            self._ctx = _connect(ray, address)
        except Exception as exc:  # Ray raises ConnectionError, RuntimeError, grpc errors: all mean "cannot use it"
            raise PoolError(f"--pool {address}: Ray could not connect ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0] if str(exc) else ''}); check that the address is the "
                            "head's Ray Client port and that Ray's version matches the cluster's.") from None
        self._remote = ray.remote(judge_in_worker)
        self._starts = ray.remote(num_cpus=0)(_Starts).remote()
        self._refs: dict[str, object] = {}
        self._lock = threading.Lock()

    # ---- devices ----------------------------------------------------------------------------------

    def _largest_gpu_node(self) -> int:
        nodes = [n for n in self._ray.nodes() if n.get("Alive")]
        return int(max((n.get("Resources", {}).get("GPU", 0) for n in nodes), default=0))

    def detect_device(self, requested: str | None) -> str:
        """``cuda`` when requested or when a node has GPUs (``auto``), else ``cpu``.

        Raises:
            ValueError: an unknown device, or ``cuda`` on a cluster without GPUs.
        """
        gpus = self._largest_gpu_node()
        if requested in (None, "auto"):
            return "cuda" if gpus else "cpu"
        if requested not in ("cpu", "cuda"):
            raise ValueError(f"--device {requested!r}: expected cpu, cuda or auto.")
        if requested == "cuda" and not gpus:
            raise ValueError(f"--device cuda: no node of the pool {self.spec} has a GPU; use --device cpu or add "
                             "GPU nodes to the cluster.")
        return requested

    # ---- verdicts ---------------------------------------------------------------------------------

    def options_for(self, task, device: str) -> dict[str, float]:
        """The Ray options of a verdict (:func:`resources_for`); checked against the cluster.

        Raises:
            PoolError: on ``cuda``, no node has as many GPUs as the verdict needs.
        """
        opts = resources_for(task, device)
        if device == "cuda" and opts["num_gpus"] > self._largest_gpu_node():
            raise PoolError(f"Pool {self.spec}: a {task.task_id} verdict on cuda needs {opts['num_gpus']:g} GPUs on "
                            f"one node (its ranks stay on one node); the largest node has {self._largest_gpu_node()}. "
                            "Add a node with that many GPUs, or narrow the task's tp_sizes.")
        return opts

    def run_guards(self, repo_root: Path, task, cand, *, device: str, seed: int, guards: Sequence[Guard],
                   label: str):
        """Submit the verdict as a Ray task, follow it on the board, return its guards phase.

        Raises:
            PoolError: see :meth:`options_for` and :func:`make_bundle`.
        """
        from workbench import env as envmod

        opts = self.options_for(task, device)
        request = JudgeRequest(label=label, task_id=task.task_id, bundle=make_bundle(repo_root, cand, label),
                               source=cand.source, kind=cand.kind, branch=cand.branch, base_commit=cand.base_commit,
                               candidate_commit=cand.candidate_commit, device=device,
                               world_size=world_size_of(task) if device == "cuda" else 1, seed=seed,
                               guards=tuple(guards))
        self.board.update(repo_root, label, "queued")
        ref = self._remote.options(**opts, max_retries=self.max_retries, retry_exceptions=False).remote(
            request, self._starts)
        with self._lock:
            self._refs[label] = ref
        try:
            while True:
                ready, _ = self._ray.wait([ref], timeout=POLL_S)
                seen = self._ray.get(self._starts.get.remote(label))
                if seen is not None:
                    node, pid, tries = seen
                    self.board.update(repo_root, label, "running", node=node, pid=pid, tries=tries)
                if ready:
                    break
            try:
                phase = self._ray.get(ref)
            except self._ray.exceptions.RayTaskError as exc:
                cause = getattr(exc, "cause", None) or exc
                reason = (str(cause) if isinstance(cause, DeviceRefused) else
                          f"The pool's worker failed outside the guards: {type(cause).__name__}: {cause}")
                phase = error_phase(guards, reason.splitlines()[0], envmod.collect("cpu"))
            except self._ray.exceptions.RayError as exc:  # the worker or its node died; Ray's retries are spent
                seen = self._ray.get(self._starts.get.remote(label))
                tries = seen[2] if seen else 0
                first = (str(exc).strip().splitlines() or [""])[0]
                reason = (f"The Ray worker judging {label} died mid-verdict ({type(exc).__name__}: {first}); "
                          f"started {tries} time(s), Ray re-runs at most {self.max_retries} "
                          f"(WORKBENCH_POOL_MAX_RETRIES); judge it again.")
                phase = error_phase(guards, reason, envmod.collect("cpu"))
        finally:
            with self._lock:
                self._refs.pop(label, None)
        bad = phase.verdicts[0].guard == "pool"
        self.board.update(repo_root, label, "error" if bad else "done",
                          note=phase.verdicts[0].summary if bad else _outcome(phase))
        return phase

    def close(self) -> None:
        """Cancel every verdict still queued or running (force: their workers are killed), then disconnect."""
        with self._lock:
            refs = list(self._refs.values())
        for ref in refs:
            try:
                self._ray.cancel(ref, force=True)
            except Exception as exc:  # a verdict that finished meanwhile cannot be cancelled: nothing to do
                logger.debug("cancel: %s", exc)
        try:
            self._ray.shutdown()
        except Exception as exc:  # disconnecting from a cluster that went away: nothing left to release
            logger.debug("shutdown: %s", exc)


def wait_for_running(pool: RayPool, label: str, timeout_s: float) -> BoardEntry:
    """Block until ``label`` is ``running`` on ``pool``'s board (tests and tools that watch a verdict).

    Raises:
        TimeoutError: not running within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entry = pool.board.entries.get(label)
        if entry is not None and entry.state == "running":
            return entry
        time.sleep(0.05)
    raise TimeoutError(f"verdict {label} not running on {pool.spec} within {timeout_s:g} s")
