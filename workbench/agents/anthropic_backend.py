"""The ``anthropic`` backend: a tool-use loop on the Anthropic Messages API (official SDK).

Per attempt: a fresh conversation whose system prompt is a short role text plus the brief (marked
``cache_control: ephemeral``, so later turns and later attempts read it from the prompt cache), and a
first user message with the attempt number and the feedback on the previous attempt. Tools:
``list_files``, ``read_file``, ``write_file`` (refused outside the allowed paths, see
:mod:`workbench.agents.tools`), ``run_check`` (the public self-check) and ``submit``. Limits: model,
turns (API calls) per attempt, max tokens per response, wall-clock budget per attempt. Rate limits and
overload: the SDK retries (``max_retries``, honouring ``retry-after``); when it gives up, this backend
backs off and retries ``overload_retries`` more times within the budget. Every response's usage and
cost (:mod:`workbench.agents.pricing`) is recorded in the JSONL transcript.

The API key is read here (argument or ``ANTHROPIC_API_KEY``) and handed to the SDK client only; the
guards' child processes run with a scrubbed environment (``guards.sandbox.scrubbed_env``).

Source: issue 4 ("Backends": anthropic); Anthropic Messages API tool use and prompt caching docs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any

from workbench.agents.base import AttemptContext, AttemptOutcome, TokenUsage
from workbench.agents.pricing import cost_usd
from workbench.agents.tools import FileTools, ToolRefused
from workbench.agents.transcript import Transcript
from workbench.errors import AgentError

logger = logging.getLogger("workbench.agents.anthropic")

DEFAULT_MODEL = "claude-sonnet-4-6"
DEFAULT_MAX_TURNS = 40
DEFAULT_MAX_TOKENS = 16_000
DEFAULT_BUDGET_S = 1800.0
MAX_BACKOFF_S = 60.0
"""Longest wait between this backend's own retries (seconds)."""

SYSTEM_TEXT = (
    "You are a GPU kernel engineer working on one task of kernel-workbench, through tools only. "
    "The brief below is the task: its contract, the paths you may change, the baseline, and the rules. "
    "Read the standard implementation before writing; write whole files with write_file; run run_check "
    "to self-check; call submit when your kernel passes or when you cannot do better. The workbench, not "
    "you, judges the result, with fresh inputs you cannot see."
)

TOOLS: list[dict[str, Any]] = [
    {"name": "list_files",
     "description": "List the repository's files under a folder (paths relative to the repository root).",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string", "description": "Folder relative to the repository root; '.' for all."}},
         "required": []}},
    {"name": "read_file",
     "description": "Read a text file of the repository (up to 60000 characters from offset).",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string", "description": "File path relative to the repository root."},
         "offset": {"type": "integer", "description": "First character to return (default 0)."}},
         "required": ["path"]}},
    {"name": "write_file",
     "description": "Create or replace a whole text file. Only paths inside the task's allowed paths are accepted.",
     "input_schema": {"type": "object", "properties": {
         "path": {"type": "string", "description": "File path relative to the repository root."},
         "content": {"type": "string", "description": "The complete new file content."}},
         "required": ["path", "content"]}},
    {"name": "run_check",
     "description": "Run the self-check on the current files: allowed paths, correctness on the public seeds, "
                    "activation, and a quick perf estimate. Takes seconds to a minute.",
     "input_schema": {"type": "object", "properties": {}, "required": []}},
    {"name": "submit",
     "description": "Finish this attempt: the workbench commits the current files and judges them.",
     "input_schema": {"type": "object", "properties": {
         "summary": {"type": "string", "description": "One paragraph: what you changed and how you checked it."}},
         "required": ["summary"]}},
]


def _block_param(block: Any) -> dict[str, Any]:
    """A response content block as a request parameter (only the fields the API accepts back)."""
    t = getattr(block, "type", None)
    if t == "text":
        return {"type": "text", "text": block.text}
    if t == "tool_use":
        return {"type": "tool_use", "id": block.id, "name": block.name, "input": block.input}
    if t == "thinking":
        return {"type": "thinking", "thinking": block.thinking, "signature": block.signature}
    if t == "redacted_thinking":
        return {"type": "redacted_thinking", "data": block.data}
    return block.model_dump(exclude_none=True)


def _usage_of(model: str, usage: Any) -> TokenUsage:
    u = TokenUsage(
        input_tokens=int(getattr(usage, "input_tokens", 0) or 0),
        output_tokens=int(getattr(usage, "output_tokens", 0) or 0),
        cache_creation_input_tokens=int(getattr(usage, "cache_creation_input_tokens", 0) or 0),
        cache_read_input_tokens=int(getattr(usage, "cache_read_input_tokens", 0) or 0),
        api_calls=1,
    )
    u.cost_usd = cost_usd(model, input_tokens=u.input_tokens, output_tokens=u.output_tokens,
                          cache_creation_input_tokens=u.cache_creation_input_tokens,
                          cache_read_input_tokens=u.cache_read_input_tokens)
    return u


class AnthropicBackend:
    """Tool-use loop on the Messages API.

    Args:
        model: model id (see :mod:`workbench.agents.pricing` for the ones with a price).
        max_turns: API calls per attempt (calls, >= 1).
        max_tokens: largest response (tokens, >= 1).
        budget_s: wall-clock budget per attempt (seconds, > 0), self-checks included.
        api_key: the key; default ``ANTHROPIC_API_KEY`` from the environment.
        client: an ``anthropic.Anthropic`` client to use instead (tests pass one with a mock transport).
        max_retries: retries the SDK itself makes on 408/409/429/5xx and connection errors (count).
        overload_retries: further retries by this backend after the SDK gives up on 429/529/5xx (count).
        backoff_s: first wait of this backend's retries, doubled each time up to 60 s (seconds).
        sleep: the sleep function (tests pass a recorder).

    Raises:
        ValueError: a limit is out of range.
        AgentError: no API key and no client.
    """

    name = "anthropic"
    can_revise = True
    brief_mode = "tools"

    def __init__(self, *, model: str = DEFAULT_MODEL, max_turns: int = DEFAULT_MAX_TURNS,
                 max_tokens: int = DEFAULT_MAX_TOKENS, budget_s: float = DEFAULT_BUDGET_S,
                 api_key: str | None = None, client: Any = None, max_retries: int = 4,
                 overload_retries: int = 3, backoff_s: float = 2.0,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not model or not isinstance(model, str):
            raise ValueError("--model: give a model id such as claude-sonnet-4-6.")
        if max_turns < 1:
            raise ValueError(f"--max-turns {max_turns}: must be at least 1 (API calls per attempt).")
        if max_tokens < 1:
            raise ValueError(f"--max-tokens {max_tokens}: must be at least 1 (tokens per response).")
        if not budget_s > 0:
            raise ValueError(f"--budget-s {budget_s}: must be positive (seconds per attempt).")
        if overload_retries < 0 or max_retries < 0:
            raise ValueError("retry counts must be >= 0.")
        self.model, self.max_turns, self.max_tokens, self.budget_s = model, max_turns, max_tokens, float(budget_s)
        self.overload_retries, self.backoff_s, self._sleep = overload_retries, backoff_s, sleep
        if client is None:
            import anthropic

            key = api_key or os.environ.get("ANTHROPIC_API_KEY")
            if not key:
                raise AgentError("--backend anthropic needs an API key: set ANTHROPIC_API_KEY (the key reaches the "
                                 "API client only; candidate code and guard children never see it).")
            client = anthropic.Anthropic(api_key=key, max_retries=max_retries)
        self.client = client
        self.label = f"anthropic:{model}"

    # -- one API call with retries ------------------------------------------------------------------
    def _create(self, *, system: list[dict], messages: list[dict], deadline: float, tr: Transcript) -> Any:
        import anthropic

        retryable = (anthropic.RateLimitError, anthropic.InternalServerError, anthropic.APIConnectionError)
        for i in range(self.overload_retries + 1):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                return self.client.messages.create(model=self.model, max_tokens=self.max_tokens, system=system,
                                                   tools=TOOLS, messages=messages, timeout=min(remaining, 600.0))
            except retryable as exc:
                status = getattr(exc, "status_code", None)
                delay = min(MAX_BACKOFF_S, self.backoff_s * (2 ** i)) * (0.75 + 0.5 * random.random())
                if i == self.overload_retries or time.monotonic() + delay >= deadline:
                    tr.write("api_error", status=status, error=type(exc).__name__, message=str(exc)[:500], final=True)
                    raise AgentError(f"Anthropic API kept failing ({type(exc).__name__}, status {status}) after "
                                     f"{i + 1} tries with SDK retries; try later or raise --budget-s.") from exc
                logger.warning("anthropic %s (status %s): retry %d/%d in %.1f s", type(exc).__name__, status,
                               i + 1, self.overload_retries, delay)
                tr.write("retry", status=status, error=type(exc).__name__, delay_s=round(delay, 2), retry=i + 1)
                self._sleep(delay)
            except anthropic.APIStatusError as exc:
                tr.write("api_error", status=exc.status_code, error=type(exc).__name__, message=str(exc)[:500], final=True)
                hint = " Check ANTHROPIC_API_KEY." if exc.status_code in (401, 403) else ""
                raise AgentError(f"Anthropic API refused the request ({exc.status_code} {type(exc).__name__}): "
                                 f"{str(exc)[:300]}.{hint}") from exc
        return None  # pragma: no cover - the loop always returns or raises

    # -- tools ----------------------------------------------------------------------------------------
    def _tool(self, name: str, args: dict[str, Any], files: FileTools, ctx: AttemptContext) -> tuple[str, bool]:
        try:
            if name == "list_files":
                return files.list_files(str(args.get("path") or ".")), False
            if name == "read_file":
                return files.read_file(str(args.get("path", "")), int(args.get("offset") or 0)), False
            if name == "write_file":
                return files.write_file(args.get("path", ""), args.get("content")), False
            if name == "run_check":
                logger.info("tool run_check in %s", ctx.worktree)
                return ctx.self_check(), False
            if name == "submit":
                return "Submitted: the workbench now commits and judges your files.", False
            return f"Unknown tool {name!r}; the tools are list_files, read_file, write_file, run_check, submit.", True
        except ToolRefused as exc:
            logger.info("tool %s refused: %s", name, exc)
            return str(exc), True
        except (TypeError, ValueError) as exc:
            return f"Bad arguments for {name}: {exc}", True
        except OSError as exc:
            logger.warning("tool %s failed: %s", name, exc)
            return f"{name} failed: {exc}", True

    # -- the attempt ----------------------------------------------------------------------------------
    def attempt(self, ctx: AttemptContext) -> AttemptOutcome:
        """Run one attempt's tool-use loop in ``ctx.worktree``.

        Raises:
            AgentError: the API refuses the request or keeps failing after all retries.
        """
        t0 = time.monotonic()
        deadline = t0 + self.budget_s
        tr = Transcript(ctx.transcript_path)
        files = FileTools(ctx.worktree, ctx.task)
        tr.write("start", backend=self.name, model=self.model, attempt=ctx.attempt, attempts=ctx.attempts,
                 max_turns=self.max_turns, max_tokens=self.max_tokens, budget_s=self.budget_s,
                 brief_file=str(ctx.brief_file), brief_sha256=hashlib.sha256(ctx.brief_text.encode()).hexdigest(),
                 feedback_file=str(ctx.feedback_file) if ctx.feedback_file else None)
        logger.info("anthropic attempt %d/%d: model %s, %d turns, %.0f s", ctx.attempt, ctx.attempts, self.model,
                    self.max_turns, self.budget_s)
        system = [{"type": "text", "text": SYSTEM_TEXT},
                  {"type": "text", "text": ctx.brief_text, "cache_control": {"type": "ephemeral"}}]
        first = f"Attempt {ctx.attempt} of {ctx.attempts}."
        if ctx.feedback_text:
            first += " Your previous attempt was rejected; the workbench's feedback follows.\n\n" + ctx.feedback_text
        else:
            first += " Start by reading the standard implementation and the kernel folder."
        messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": first}]}]
        tr.write("user", content=messages[0]["content"])
        usage = TokenUsage()
        stop, submitted, note = "max_turns", False, ""
        for turn in range(1, self.max_turns + 1):
            self._mark_cache(messages)
            resp = self._create(system=system, messages=messages, deadline=deadline, tr=tr)
            if resp is None:
                stop = "budget"
                break
            u = _usage_of(self.model, resp.usage)
            usage.add(u)
            content = [_block_param(b) for b in resp.content]
            tr.write("response", turn=turn, stop_reason=resp.stop_reason, content=content, usage=u.to_dict())
            logger.info("anthropic turn %d: stop_reason %s, %d in / %d out tokens (cache %d read, %d written)", turn,
                        resp.stop_reason, u.input_tokens, u.output_tokens, u.cache_read_input_tokens,
                        u.cache_creation_input_tokens)
            messages.append({"role": "assistant", "content": content})
            uses = [b for b in resp.content if getattr(b, "type", None) == "tool_use"]
            if not uses:
                if resp.stop_reason == "max_tokens":
                    messages.append({"role": "user", "content": [{"type": "text", "text":
                                     "Your reply hit max_tokens. Continue; write smaller files or fewer at once."}]})
                    continue
                stop = str(resp.stop_reason or "end_turn")
                break
            results = []
            for b in uses:
                args = b.input if isinstance(b.input, dict) else {}
                out, is_error = self._tool(b.name, args, files, ctx)
                tr.write("tool", turn=turn, name=b.name, input=args, is_error=is_error, result=out)
                results.append({"type": "tool_result", "tool_use_id": b.id, "content": out, "is_error": is_error})
                if b.name == "submit":
                    submitted, note = True, str(args.get("summary", ""))
            messages.append({"role": "user", "content": results})
            if submitted:
                stop = "submitted"
                break
            if time.monotonic() >= deadline:
                stop = "budget"
                break
        dur = round(time.monotonic() - t0, 3)
        tr.write("end", stop_reason=stop, submitted=submitted, usage=usage.to_dict(), duration_s=dur)
        logger.info("anthropic attempt %d ended: %s (%d calls, cost %s USD)", ctx.attempt, stop, usage.api_calls,
                    usage.cost_usd)
        return AttemptOutcome(stop_reason=stop, submitted=submitted, usage=usage, note=note, duration_s=dur)

    @staticmethod
    def _mark_cache(messages: list[dict[str, Any]]) -> None:
        """Move the conversation's cache breakpoint to the last block of the last message (the brief
        in the system prompt keeps its own), so each turn reads the previous turns from the cache."""
        for m in messages:
            for block in m["content"]:
                block.pop("cache_control", None)
        last = messages[-1]["content"][-1]
        last["cache_control"] = {"type": "ephemeral"}
