"""One interface for every agent backend, and the records one attempt leaves.

An attempt is: the backend gets an :class:`AttemptContext` (the worktree, the brief, the feedback on
the previous attempt), changes files in the worktree, and returns an :class:`AttemptOutcome`. The
runner then commits whatever the worktree holds and the guards judge that commit: no backend judges
itself, and a backend's own claims (``submitted``) are recorded, never trusted.

Source: issue 4 ("Backends, one interface"); STYLE.md (small Protocols, one typed result).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from workbench.taskspec import TaskSpec


@dataclasses.dataclass
class TokenUsage:
    """Tokens an API agent used (tokens) and what they cost (US dollars).

    Attributes:
        input_tokens: uncached input tokens.
        output_tokens: generated tokens.
        cache_creation_input_tokens: input tokens written to the prompt cache.
        cache_read_input_tokens: input tokens read from the prompt cache.
        api_calls: Messages API responses received (calls).
        cost_usd: price of the tokens above, or ``None`` when the model has no entry in the price table.
    """

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    api_calls: int = 0
    cost_usd: float | None = 0.0

    def add(self, other: TokenUsage) -> None:
        """Accumulate ``other`` into this one (a ``None`` cost makes the total ``None``)."""
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.cache_creation_input_tokens += other.cache_creation_input_tokens
        self.cache_read_input_tokens += other.cache_read_input_tokens
        self.api_calls += other.api_calls
        self.cost_usd = None if self.cost_usd is None or other.cost_usd is None else round(self.cost_usd + other.cost_usd, 6)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready copy."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class AttemptContext:
    """Everything a backend may use for one attempt.

    Attributes:
        task: the task spec.
        repo_root: the workbench's checkout.
        worktree: the agent's worktree (the only place it may change files).
        base_commit: SHA the candidate is judged against.
        attempt: 1-based attempt number.
        attempts: attempts allowed in this run.
        brief_file: the brief (outside the worktree's tracked files).
        brief_text: its contents.
        feedback_file: feedback on the previous attempt (``None`` on attempt 1).
        feedback_text: its contents (``None`` on attempt 1).
        prompt_file: brief plus feedback in one file (for CLI agents that take one prompt).
        transcript_path: where the backend writes its transcript (JSONL).
        device: ``cpu`` or ``cuda``.
        self_check: runs the public self-check on the worktree and returns its text report.
    """

    task: TaskSpec
    repo_root: Path
    worktree: Path
    base_commit: str
    attempt: int
    attempts: int
    brief_file: Path
    brief_text: str
    feedback_file: Path | None
    feedback_text: str | None
    prompt_file: Path
    transcript_path: Path
    device: str
    self_check: Callable[[], str]


@dataclasses.dataclass
class AttemptOutcome:
    """What a backend reports about one attempt (data, never trusted as a verdict).

    Attributes:
        stop_reason: why the attempt ended (``submitted``, ``max_turns``, ``budget``, ``end_turn``,
            ``exit_code=N``, ``timeout``, ``applied``, ``nothing_new``...).
        submitted: the agent said it was done (``submit`` tool, exit code 0, a patch applied).
        usage: tokens and cost (API backends; zero otherwise).
        note: the agent's own summary, if it gave one.
        duration_s: wall time of the attempt (seconds).
    """

    stop_reason: str
    submitted: bool
    usage: TokenUsage = dataclasses.field(default_factory=TokenUsage)
    note: str = ""
    duration_s: float = 0.0


class AgentBackend(Protocol):
    """Produces a candidate by changing files in a worktree, one attempt at a time.

    Attributes:
        name: ``anthropic``, ``command`` or ``patch``.
        label: what result files record as ``candidate.agent`` (backend and model or command).
        can_revise: whether a later attempt can differ from the first (False for a fixed patch).
    """

    name: str
    label: str
    can_revise: bool

    def attempt(self, ctx: AttemptContext) -> AttemptOutcome:
        """Change files in ``ctx.worktree``; raise only when the backend itself cannot work.

        Raises:
            AgentError: the backend cannot run (missing API key, API failing after retries, a command
                that cannot start); the run stops with exit code 2.
        """
        ...
