"""The ``command`` backend: any CLI coding agent, run in the worktree from a command template.

The template is split like a shell line (``shlex``) but never run through a shell; each word may use
the placeholders ``{brief_file}``, ``{prompt_file}`` (brief plus feedback), ``{prompt}`` (that text),
``{feedback_file}`` (empty on attempt 1), ``{worktree}``, ``{task}``, ``{base}``, ``{attempt}`` and
``{attempts}``. Example: ``claude -p {prompt} --allowedTools Edit,Bash``.

Environment: the agent gets **only** ``PATH`` (with this Python's folder first), ``LANG``, ``LC_ALL``,
``TERM``, ``TZ``, a private ``HOME`` under ``.workbench/agent-home/``, the ``WORKBENCH_*`` variables
below, and the variables named with ``--agent-env NAME`` (e.g. ``ANTHROPIC_API_KEY`` for an agent that
calls the API itself, or ``HOME`` for one that keeps its login there). Whatever it passes on, the
guard children it starts through ``workbench check`` run with the sandbox's scrubbed environment.

It runs in its own process group with a wall-clock limit; the group is killed when the limit is hit
and again after the agent exits (no leftover process edits the worktree while it is judged). The
runner then commits whatever the agent left.

Source: issue 4 ("Backends": command).
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import string
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

from workbench.agents.base import AttemptContext, AttemptOutcome
from workbench.agents.transcript import Transcript
from workbench.errors import AgentError

logger = logging.getLogger("workbench.agents.command")

PLACEHOLDER_MEANINGS: dict[str, str] = {
    "brief_file": "path of the brief file",
    "prompt_file": "path of the prompt file (the brief, then the previous attempt's feedback)",
    "prompt": "the prompt file's text",
    "feedback_file": "path of the previous attempt's feedback file (empty on the first attempt)",
    "worktree": "path of the candidate's worktree (the command's working directory)",
    "task": "the task id",
    "base": "the base commit",
    "attempt": "this attempt's number (from 1)",
    "attempts": "how many attempts the run allows",
}
"""Every placeholder of ``--agent-cmd`` and what it is replaced with (the brief lists them from here)."""
PLACEHOLDERS = tuple(PLACEHOLDER_MEANINGS)
BASE_ENV = ("PATH", "LANG", "LC_ALL", "TERM", "TZ")
"""Variables every command agent gets from the workbench's environment (when set)."""
MAX_OUTPUT_CHARS = 200_000
"""Characters of each output stream kept in the transcript (characters)."""
DEFAULT_BUDGET_S = 1800.0


def template_fields(template: str) -> list[str]:
    """Placeholder names used in a template.

    Raises:
        ValueError: the template is empty, cannot be split, or uses an unknown placeholder.
    """
    try:
        words = shlex.split(template)
    except ValueError as exc:
        raise ValueError(f"--agent-cmd {template!r}: cannot be split into words ({exc}); check the quotes.") from None
    if not words:
        raise ValueError("--agent-cmd is empty; give a command such as 'claude -p {prompt}'.")
    names = []
    for w in words:
        try:
            parsed = list(string.Formatter().parse(w))
        except ValueError as exc:
            raise ValueError(f"--agent-cmd word {w!r}: {exc}; write literal braces as {{{{ and }}}}.") from None
        for _, field, _, _ in parsed:
            if field is None:
                continue
            if field not in PLACEHOLDERS:
                raise ValueError(f"--agent-cmd uses unknown placeholder {{{field}}}; known: "
                                 + ", ".join("{" + p + "}" for p in PLACEHOLDERS) + ".")
            names.append(field)
    return names


class CommandBackend:
    """Runs a CLI agent once per attempt.

    Args:
        template: the command template (see the module docstring).
        budget_s: wall-clock limit per attempt (seconds, > 0).
        env_allow: extra variable names passed through from the workbench's environment.

    Raises:
        ValueError: a bad template, budget or variable name.
    """

    name = "command"
    can_revise = True
    brief_mode = "shell"

    def __init__(self, template: str, *, budget_s: float = DEFAULT_BUDGET_S, env_allow: Iterable[str] = ()) -> None:
        template_fields(template)
        if not budget_s > 0:
            raise ValueError(f"--budget-s {budget_s}: must be positive (seconds per attempt).")
        self.env_allow = tuple(env_allow)
        for n in self.env_allow:
            if not n or "=" in n or not n.replace("_", "a").isalnum():
                raise ValueError(f"--agent-env {n!r}: give a variable name such as ANTHROPIC_API_KEY.")
        self.template, self.budget_s = template, float(budget_s)
        self.label = f"command:{Path(shlex.split(template)[0]).name}"

    def preflight(self) -> None:
        """Check, before any worktree exists, that the command's program can be started.

        Raises:
            AgentError: the program is neither a path to an executable file nor on the agent's PATH (the
                workbench's Python directory, then the caller's PATH).
        """
        prog = shlex.split(self.template)[0]
        if "{" in prog:  # a placeholder chooses the program: only the attempt can tell
            return
        path = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
        if shutil.which(prog, path=path) is None:
            raise AgentError(f"--agent-cmd: cannot start {prog!r}: not an executable file and not on PATH; install it "
                             "or give its full path. Nothing was created.")

    def argv(self, ctx: AttemptContext) -> list[str]:
        """The command line for one attempt (placeholders filled, no shell)."""
        values = {"brief_file": str(ctx.brief_file), "prompt_file": str(ctx.prompt_file),
                  "prompt": ctx.prompt_file.read_text(encoding="utf-8"),
                  "feedback_file": str(ctx.feedback_file) if ctx.feedback_file else "",
                  "worktree": str(ctx.worktree), "task": ctx.task.task_id, "base": ctx.base_commit,
                  "attempt": str(ctx.attempt), "attempts": str(ctx.attempts)}
        return [w.format_map(values) for w in shlex.split(self.template)]

    def environment(self, ctx: AttemptContext) -> dict[str, str]:
        """The agent's whole environment (see the module docstring); logs names, never values."""
        env = {k: os.environ[k] for k in BASE_ENV if k in os.environ}
        py_dir = str(Path(sys.executable).parent)
        env["PATH"] = py_dir + (os.pathsep + env["PATH"] if env.get("PATH") else "")
        home = Path(ctx.repo_root) / ".workbench" / "agent-home" / ctx.worktree.name
        home.mkdir(parents=True, exist_ok=True)
        env["HOME"] = str(home)
        for n in self.env_allow:
            if n in os.environ:
                env[n] = os.environ[n]
            else:
                logger.warning("--agent-env %s: not set in the workbench's environment; not passed", n)
        env.update(WORKBENCH_TASK=ctx.task.task_id, WORKBENCH_BRIEF=str(ctx.brief_file),
                   WORKBENCH_PROMPT=str(ctx.prompt_file), WORKBENCH_FEEDBACK=str(ctx.feedback_file or ""),
                   WORKBENCH_WORKTREE=str(ctx.worktree), WORKBENCH_BASE=ctx.base_commit,
                   WORKBENCH_ATTEMPT=str(ctx.attempt), WORKBENCH_ATTEMPTS=str(ctx.attempts))
        return env

    def attempt(self, ctx: AttemptContext) -> AttemptOutcome:
        """Run the command in the worktree until it exits or the budget ends.

        Raises:
            AgentError: the command cannot be started (not found, not executable).
        """
        tr = Transcript(ctx.transcript_path)
        argv = self.argv(ctx)
        env = self.environment(ctx)
        shown = [a if len(a) < 300 else a[:120] + f"...[{len(a)} chars]" for a in argv]
        tr.write("start", backend=self.name, argv=shown, cwd=str(ctx.worktree), env_names=sorted(env),
                 attempt=ctx.attempt, attempts=ctx.attempts, budget_s=self.budget_s, brief_file=str(ctx.brief_file))
        logger.info("command attempt %d/%d: %s (env: %s)", ctx.attempt, ctx.attempts, shown[0], ", ".join(sorted(env)))
        out_path = ctx.transcript_path.with_suffix(".stdout")
        err_path = ctx.transcript_path.with_suffix(".stderr")
        t0 = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                proc = subprocess.Popen(argv, cwd=str(ctx.worktree), env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=err, start_new_session=True)
            except OSError as exc:
                tr.write("end", stop_reason="not_started", error=str(exc))
                raise AgentError(f"--agent-cmd: cannot start {argv[0]!r}: {exc.strerror or exc}; check the command "
                                 "and that it is on PATH.") from None
            timed_out = False
            try:
                rc = proc.wait(timeout=self.budget_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                logger.warning("command attempt %d: budget of %.0f s reached; killing its process group",
                               ctx.attempt, self.budget_s)
                _killpg(proc.pid)
                rc = proc.wait()
            _killpg(proc.pid)  # leftovers must not edit the worktree while it is judged
        dur = round(time.monotonic() - t0, 3)
        for stream, path in (("stdout", out_path), ("stderr", err_path)):
            text = path.read_text(encoding="utf-8", errors="replace")
            if text:
                tr.write("output", stream=stream, text=text[-MAX_OUTPUT_CHARS:], truncated=len(text) > MAX_OUTPUT_CHARS)
        stop = "timeout" if timed_out else f"exit_code={rc}"
        tr.write("end", stop_reason=stop, returncode=rc, duration_s=dur)
        logger.info("command attempt %d ended: %s after %.1f s", ctx.attempt, stop, dur)
        return AttemptOutcome(stop_reason=stop, submitted=(rc == 0 and not timed_out), duration_s=dur)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
