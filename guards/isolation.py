"""Isolation guard: the candidate changes only its task's allowed paths.

Every changed path (both sides of renames) must match an ``allowed_paths`` glob and no
always-forbidden glob; symlinks may not point outside the allowed paths; no binary blobs.

Source: DESIGN.md "Contracts" (Task: allowed and always-forbidden paths); issue 2 guard 1.
"""

from __future__ import annotations

import posixpath
import re
from functools import lru_cache

import git

from guards.base import GuardContext
from guards.verdict import Evidence, Status, Verdict

MAX_FILE_BYTES = 1_000_000
"""Largest text file a candidate may add (bytes); kernels are source, not data."""


@lru_cache(maxsize=256)
def _glob_regex(pattern: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def glob_match(path: str, pattern: str) -> bool:
    """Match a repo-relative POSIX path against a glob (``*`` within a folder, ``**`` across folders)."""
    return _glob_regex(pattern).match(path) is not None


def path_problem(path: str, allowed: tuple[str, ...], forbidden: tuple[str, ...]) -> str | None:
    """Why ``path`` may not be changed, or ``None`` if it may."""
    parts = path.split("/")
    if path.startswith("/") or ".." in parts:
        return "path leaves the repository"
    for pat in forbidden:
        if glob_match(path, pat):
            return f"always forbidden ({pat})"
    if not any(glob_match(path, pat) for pat in allowed):
        return f"outside allowed_paths ({', '.join(allowed)})"
    return None


class IsolationGuard:
    """Reads the diff base..candidate from git; never runs candidate code."""

    name = "isolation"
    reads: tuple[str, ...] = ()
    writes = ("changed_paths",)

    def check(self, ctx: GuardContext) -> Verdict:
        repo = git.Repo(ctx.repo_root)
        base = repo.commit(ctx.base_commit)
        cand = repo.commit(ctx.candidate_commit)
        diffs = base.diff(cand)
        allowed, forbidden = ctx.task.allowed_paths, ctx.task.all_forbidden
        problems: list[Evidence] = []
        changed: list[str] = []
        for d in diffs:
            for p in {d.a_path, d.b_path} - {None}:
                changed.append(p)
                why = path_problem(p, allowed, forbidden)
                if why:
                    problems.append(Evidence(name="forbidden_path", value=why, path=p))
            if d.b_blob is None:
                continue
            mode = d.b_blob.mode
            data = d.b_blob.data_stream.read()
            if mode == 0o120000:
                target = data.decode("utf-8", "replace")
                resolved = posixpath.normpath(posixpath.join(posixpath.dirname(d.b_path), target))
                why = path_problem(resolved, allowed, forbidden) if not target.startswith("/") else "absolute target"
                if why:
                    problems.append(
                        Evidence(name="symlink_escapes", value=f"-> {target} ({why})", path=d.b_path)
                    )
            elif mode not in (0o100644, 0o100755):
                problems.append(Evidence(name="unsupported_file_mode", value=oct(mode), path=d.b_path))
            elif b"\0" in data[:8192]:
                problems.append(Evidence(name="binary_blob", value=len(data), unit="bytes", path=d.b_path))
            elif len(data) > MAX_FILE_BYTES:
                problems.append(Evidence(name="file_too_large", value=len(data), unit="bytes", path=d.b_path))
        changed = sorted(set(changed))
        ctx.artifacts.changed_paths = changed
        if not changed:
            return Verdict(guard=self.name, status=Status.FAIL, summary="The candidate changes nothing.",
                           evidence=(Evidence(name="changed_paths", value=0, unit="count"),))
        if problems:
            first = problems[0]
            # a file added at the repository's root usually means an overlay folder that does not mirror the
            # repository (helper-22, session 21: /tmp/flat/__init__.py): say where it belongs
            hint = ""
            if "/" not in first.path and first.value.startswith("outside allowed_paths"):
                hint = (f" An overlay folder mirrors the repository: a file for {allowed[0]} goes at that path "
                        f"inside the folder (e.g. {allowed[0].rstrip('*').rstrip('/')}/{first.path}).")
            return Verdict(
                guard=self.name,
                status=Status.FAIL,
                summary=f"{len(problems)} change(s) outside the task's allowed paths; first: {first.path} "
                        f"({first.value}).{hint}",
                evidence=tuple(problems[:50]),
            )
        return Verdict(
            guard=self.name,
            status=Status.PASS,
            summary=f"All {len(changed)} changed path(s) lie inside {', '.join(allowed)}.",
            evidence=tuple(Evidence(name="changed_path", value="ok", path=p) for p in changed[:50]),
        )
