"""Library peers of a task's op for ``workbench bench``: what the field already runs, timed beside the kernel.

A task may hold ``tasks/<id>/peers.py`` with ``PEERS``, a list of :class:`Peer`: a pip-installable library
kernel that computes the op, or a named part of it (``covers`` says which part, in words a reviewer can
check). ``workbench bench`` times every peer that imports here in the same run and by the same method
as the kernel (graph-replayed, L2 flushed, interleaved with the kernel's graph, medians), and lists
every other one as not run with the reason. Peers are optional extras (``pip install -e '.[peers]'``),
never vendored: a missing package is a row "not run: <package> is not importable here", never an error.

Source: issue 13 item 4 (the peer column; FlashInfer, quack, FLA, cuBLAS through torch).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from collections.abc import Callable, Mapping
from typing import Any

PeerCall = Callable[[], object]
"""A zero-argument callable running one peer call on inputs and outputs it allocated up front."""


@dataclasses.dataclass(frozen=True)
class Peer:
    """One library kernel to time beside a task's kernel.

    Attributes:
        name: short identifier, used in result keys (``peer_<name>_graph_us``); letters, digits, ``_``.
        distribution: the pip distribution that provides it (its version goes into the result file).
        module: the module imported to decide whether the peer is here (``importlib.import_module``).
        covers: what part of the op the peer computes, and what it leaves out (shown in the table).
        build: ``build(inputs, kwargs) -> PeerCall``: inputs are the case's CUDA tensors (the kernel's
            own inputs, names as in the task's reference), kwargs the op's keyword arguments; the
            returned callable allocates nothing that the first call did not (a CUDA graph captures it).
            ``None``: the peer is declared for the record but has no adapter yet (``note`` says why);
            it is listed as not run.
        applies: ``applies(axes, kwargs) -> str | None``: why the peer cannot run this configuration
            (e.g. a power-of-two size it needs), or ``None`` when it can.
    """

    name: str
    distribution: str
    module: str
    covers: str
    build: Callable[[Mapping[str, Any], Mapping[str, Any]], PeerCall] | None
    applies: Callable[[Mapping[str, int], Mapping[str, Any]], str | None] = lambda axes, kwargs: None
    note: str = ""

    def __post_init__(self) -> None:
        if not self.name.replace("_", "").isalnum() or not self.name.isascii():
            raise ValueError(f"Peer name {self.name!r}: use letters, digits and '_' (it becomes a result key).")

    def missing(self) -> str | None:
        """Why the peer cannot run here (no adapter, or its module does not import), or ``None`` (never raises)."""
        if self.build is None:
            return f"no adapter written yet: {self.note or 'see the task peers.py'}"
        try:
            importlib.import_module(self.module)
        except Exception as exc:  # an ImportError, or a library that fails on import without a GPU
            return (f"{self.distribution} is not importable here ({type(exc).__name__}: {exc}); "
                    f"`pip install -e '.[peers]'` on a CUDA machine")
        return None

    def version(self) -> str | None:
        """The installed version of :attr:`distribution`, or ``None``."""
        try:
            return importlib.metadata.version(self.distribution)
        except importlib.metadata.PackageNotFoundError:
            return None

    def describe(self) -> dict[str, Any]:
        """The peer's entry in a result file: name, distribution, version, covers, run / not run and why."""
        why = self.missing()
        return {"name": self.name, "distribution": self.distribution, "version": self.version(),
                "covers": self.covers, "status": "not run" if why else "run", "reason": why}


def task_peers(task: Any) -> list[Peer]:
    """The peers a task declares (``tasks/<id>/peers.py`` ``PEERS``), or ``[]`` when it has no such file.

    Raises:
        TypeError: ``PEERS`` is not a list of :class:`Peer` (the file's path named).
        workbench.taskspec.TaskSpecError: the file raises on import.
    """
    from pathlib import Path

    from guards.cases import load_task_module

    if not (Path(task.root) / "peers.py").is_file():
        return []
    peers = getattr(load_task_module(task, "peers"), "PEERS", None)
    if not isinstance(peers, list) or not all(isinstance(p, Peer) for p in peers):
        raise TypeError(f"{Path(task.root) / 'peers.py'}: PEERS must be a list of workbench.peers.Peer; "
                        f"got {type(peers).__name__}.")
    return peers
