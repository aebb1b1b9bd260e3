"""The ``patch`` backend: an existing candidate (a person's patch, an overlay folder, a branch) replayed
into an agent worktree.

``workbench run TASK --candidate SOURCE`` keeps its own path (``workbench.pipeline.run_candidate``),
unchanged; this backend is the same source behind the :class:`AgentBackend` interface, so the runner
can replay a recorded contribution through the attempt loop (same brief, run record, result naming).
It cannot revise: a second attempt adds nothing.

Source: issue 4 ("Backends": patch).
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

from workbench.agents.base import AttemptContext, AttemptOutcome
from workbench.agents.transcript import Transcript
from workbench.errors import CandidateError

logger = logging.getLogger("workbench.agents.patch")


class PatchBackend:
    """Applies one fixed candidate on attempt 1.

    Args:
        source: a ``.patch`` file, an overlay folder, or a branch/commit of the workbench's repository.
        repo_root: the workbench's checkout (to resolve a branch).

    Raises:
        CandidateError: the source is neither a file, a folder nor a git revision.
    """

    name = "patch"
    can_revise = False
    brief_mode = "shell"

    def __init__(self, source: str, repo_root: Path) -> None:
        from workbench.worktree import classify_source, open_repo

        self.repo = open_repo(Path(repo_root))
        self.source = source
        self.kind = classify_source(self.repo, source)
        self.label = f"patch:{Path(source).name if self.kind != 'branch' else source}"

    def attempt(self, ctx: AttemptContext) -> AttemptOutcome:
        """Apply the source into ``ctx.worktree`` (attempt 1 only).

        Raises:
            CandidateError: the patch or branch does not apply to the base.
        """
        from workbench.worktree import _overlay

        tr = Transcript(ctx.transcript_path)
        tr.write("start", backend=self.name, source=self.source, kind=self.kind, attempt=ctx.attempt)
        if ctx.attempt > 1:
            tr.write("end", stop_reason="nothing_new")
            return AttemptOutcome(stop_reason="nothing_new", submitted=False)
        if self.kind == "folder":
            from workbench.fixtures import overlay_source

            _overlay(overlay_source(Path(self.source)), ctx.worktree)
        else:
            if self.kind == "patch":
                diff = Path(self.source).read_bytes()
            else:
                tip = self.repo.commit(self.source).hexsha
                diff = subprocess.run(["git", "-C", str(ctx.worktree), "diff", "--binary", ctx.base_commit, tip],
                                      capture_output=True, check=True).stdout
            proc = subprocess.run(["git", "-C", str(ctx.worktree), "apply", "--whitespace=nowarn", "-"], input=diff,
                                  capture_output=True)
            if proc.returncode != 0:
                tr.write("end", stop_reason="does_not_apply", error=proc.stderr.decode(errors="replace")[-2000:])
                raise CandidateError(f"Candidate {self.source} does not apply to base {ctx.base_commit[:10]}: "
                                     f"{proc.stderr.decode(errors='replace').strip().splitlines()[-1:]}. Rebase it.")
        logger.info("patch attempt 1: applied %s %s", self.kind, self.source)
        tr.write("end", stop_reason="applied")
        return AttemptOutcome(stop_reason="applied", submitted=True)
