"""File tools an API agent uses in its worktree: list, read and write, with writes confined.

A write is refused unless its path, taken relative to the worktree, is inside the task's
``allowed_paths`` and outside every always-forbidden glob (``guards.isolation.path_problem``, the
same rule the isolation guard applies), contains no ``..`` and no absolute part, and no component on
the way (the file itself included) is a symlink. Reads may look anywhere inside the worktree but
never leave it (symlinks are resolved and checked). Refusals come back as text for the agent; they
are also logged.

Source: issue 4 ("writes refused outside the allowed paths"); guards/isolation.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path, PurePosixPath

from guards.isolation import path_problem
from workbench.taskspec import TaskSpec

logger = logging.getLogger("workbench.agents.tools")

MAX_READ_CHARS = 60_000
"""Characters returned by one read_file call (characters); longer files are paged with ``offset``."""
MAX_WRITE_BYTES = 400_000
"""Largest file write_file accepts (bytes); kernels are source, not data."""
MAX_LIST_ENTRIES = 400
"""Paths returned by one list_files call (count)."""


class ToolRefused(Exception):
    """A tool call the agent may not make; the message goes back to the agent as the tool's result."""


class FileTools:
    """list_files / read_file / write_file confined to one worktree and one task's allowed paths.

    Args:
        worktree: the agent's worktree.
        task: the task (its ``allowed_paths`` and the always-forbidden globs).
    """

    def __init__(self, worktree: Path, task: TaskSpec) -> None:
        self.worktree = Path(worktree).resolve()
        self.task = task

    def _rel(self, path: str) -> PurePosixPath:
        if not isinstance(path, str) or not path.strip():
            raise ToolRefused("path is empty; give a path relative to the repository root, e.g. k3_model/kernels/<op>/__init__.py.")
        p = PurePosixPath(path.strip().replace("\\", "/"))
        if p.is_absolute():
            raise ToolRefused(f"{path!r} is absolute; give a path relative to the repository root.")
        if ".." in p.parts:
            raise ToolRefused(f"{path!r} contains '..'; paths must stay inside the repository.")
        parts = [q for q in p.parts if q not in ("", ".")]
        if parts and parts[0] == ".git":
            raise ToolRefused(f"{path!r} is inside .git; the repository's git data is off limits.")
        return PurePosixPath(*parts) if parts else PurePosixPath(".")

    def _inside(self, rel: PurePosixPath) -> Path:
        full = (self.worktree / rel).resolve()
        if full != self.worktree and self.worktree not in full.parents:
            raise ToolRefused(f"{str(rel)!r} resolves outside the repository (through a symlink).")
        return full

    def list_files(self, path: str = ".") -> str:
        """Files (tracked and new, not ignored) under ``path``, one per line, capped at MAX_LIST_ENTRIES."""
        rel = self._rel(path or ".")
        self._inside(rel)
        out = subprocess.run(["git", "-C", str(self.worktree), "ls-files", "--cached", "--others", "--exclude-standard",
                              "--", str(rel)], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        files = sorted(set(out.stdout.split("\n")) - {""})
        logger.info("tool list_files %s: %d entries", rel, len(files))
        if not files:
            return f"(no files under {rel})"
        more = f"\n... and {len(files) - MAX_LIST_ENTRIES} more" if len(files) > MAX_LIST_ENTRIES else ""
        return "\n".join(files[:MAX_LIST_ENTRIES]) + more

    def read_file(self, path: str, offset: int = 0) -> str:
        """Up to MAX_READ_CHARS characters of a text file from ``offset`` (characters).

        Raises:
            ToolRefused: the path leaves the worktree, is not a file, or is not text.
        """
        rel = self._rel(path)
        full = self._inside(rel)
        if not full.is_file():
            raise ToolRefused(f"{str(rel)!r} is not a file; use list_files to see what exists.")
        data = full.read_bytes()
        if b"\0" in data[:8192]:
            raise ToolRefused(f"{str(rel)!r} is binary; only text files can be read.")
        text = data.decode("utf-8", "replace")
        offset = max(0, int(offset or 0))
        chunk = text[offset:offset + MAX_READ_CHARS]
        logger.info("tool read_file %s offset %d: %d chars", rel, offset, len(chunk))
        tail = ""
        if offset + MAX_READ_CHARS < len(text):
            tail = f"\n[... {len(text) - offset - MAX_READ_CHARS} more characters; read again with offset={offset + MAX_READ_CHARS}]"
        return chunk + tail

    def check_writable(self, path: str) -> PurePosixPath:
        """The normalised relative path if ``path`` may be written.

        Raises:
            ToolRefused: outside the allowed paths, always forbidden, through or onto a symlink, or a folder.
        """
        rel = self._rel(path)
        why = path_problem(str(rel), self.task.allowed_paths, self.task.all_forbidden)
        if why:
            raise ToolRefused(f"write to {str(rel)!r} refused: {why}. You may write only "
                              f"{', '.join(self.task.allowed_paths)}.")
        cur = self.worktree
        for part in rel.parts:
            cur = cur / part
            if cur.is_symlink():
                raise ToolRefused(f"write to {str(rel)!r} refused: {cur.relative_to(self.worktree)} is a symlink.")
        if cur.is_dir():
            raise ToolRefused(f"write to {str(rel)!r} refused: it is a folder.")
        self._inside(rel)
        return rel

    def write_file(self, path: str, content: str) -> str:
        """Create or replace a text file inside the allowed paths.

        Raises:
            ToolRefused: see :meth:`check_writable`; also content that is not text or too large.
        """
        rel = self.check_writable(path)
        if not isinstance(content, str):
            raise ToolRefused("content must be a string (the whole file).")
        data = content.encode("utf-8")
        if len(data) > MAX_WRITE_BYTES or "\0" in content:
            raise ToolRefused(f"write to {str(rel)!r} refused: content must be text below {MAX_WRITE_BYTES} bytes.")
        full = self.worktree / rel
        full.parent.mkdir(parents=True, exist_ok=True)
        # O_NOFOLLOW: a symlink planted between the check and the open is not followed.
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        logger.info("tool write_file %s: %d bytes", rel, len(data))
        return f"wrote {len(data)} bytes to {rel}"

