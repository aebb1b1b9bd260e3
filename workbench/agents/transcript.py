"""Transcripts: one JSON object per line under ``.workbench/transcripts/`` (append-only).

Every event an attempt produces is one line: the request's shape, each response (content blocks,
stop reason, usage, cost), each tool call and its result, retries, the end. No API key or request
header is ever written.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


class Transcript:
    """Append-only JSONL writer.

    Args:
        path: the ``.jsonl`` file (its folder is created).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._t0 = time.monotonic()

    def write(self, event: str, **fields: Any) -> None:
        """Append ``{"event": event, "t_s": seconds since start, **fields}``."""
        rec = {"event": event, "t_s": round(time.monotonic() - self._t0, 3), **fields}
        line = json.dumps(rec, default=str, ensure_ascii=False)
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")


def read_transcript(path: Path) -> list[dict[str, Any]]:
    """All events of a transcript, in order."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
