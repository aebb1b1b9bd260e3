"""The serving trace: one JSON line per forward step of the vLLM model, one file per process.

Each line says which phase the step was classified as, the per-request query lengths it was classified
from, and how often each op took each implementation (``"moe_dispatch:latency_specialized": 8``) with
the dispatcher's reasons, so a test (or a reviewer) can see that the latency-specialized path ran on
pure-decode steps only and the standard path everywhere else.

Enabled when ``additional_config["k3_trace_dir"]`` or the environment variable ``K3_VLLM_TRACE_DIR``
names a folder; the file is ``<dir>/k3_trace.<pid>.jsonl`` (vLLM runs the model in a worker process, and
a worker per TP rank).

Source: issue 6 ("the trace shows which path each step took"); DESIGN.md "Every decision is recorded".
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

TRACE_ENV = "K3_VLLM_TRACE_DIR"
TRACE_KEY = "k3_trace_dir"


def trace_dir(additional_config: Mapping[str, Any] | None) -> Path | None:
    """The trace folder asked for, or ``None`` (additional_config wins over the environment)."""
    value = (additional_config or {}).get(TRACE_KEY) or os.environ.get(TRACE_ENV)
    return Path(value) if value else None


class StepTrace:
    """Appends step records to ``<folder>/k3_trace.<pid>.jsonl`` (line-buffered, so a killed server
    loses at most the step it was writing).

    Args:
        folder: created if missing.
        role: a label for the model instance (``"target"``).
    """

    def __init__(self, folder: Path, role: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"k3_trace.{os.getpid()}.jsonl"
        self.role = role
        self.step = 0
        self._fh = open(self.path, "a", buffering=1, encoding="utf-8")

    def write(self, *, phase: str, query_lens: list[int], decode_backend: str,
              decisions: Iterable[Any]) -> None:
        """Record one forward step (``decisions``: :class:`k3_model.dispatch.Decision` objects)."""
        decisions = list(decisions)
        impls = Counter(f"{d.op}:{d.implementation}" for d in decisions)
        reasons = sorted({f"{d.op}:{d.implementation}: {d.reason}" for d in decisions})
        rec = {"pid": os.getpid(), "role": self.role, "step": self.step, "phase": phase,
               "num_reqs": len(query_lens), "query_lens": query_lens, "decode_backend": decode_backend,
               "implementations": dict(impls), "reasons": reasons}
        self._fh.write(json.dumps(rec) + "\n")
        self.step += 1


def read_traces(folder: str | Path) -> list[dict[str, Any]]:
    """Every record of every trace file in ``folder``, file by file in name order, steps in order."""
    out: list[dict[str, Any]] = []
    for p in sorted(Path(folder).glob("k3_trace.*.jsonl")):
        out += [json.loads(line) for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    return out
