"""Agent backends and the runner that drives them (issue 4).

Public surface: :class:`AgentBackend` (the protocol), the three backends, :func:`run_agent`, the brief
and the self-check. Backends import their SDKs lazily, so ``workbench --help`` stays fast.
"""

from workbench.agents.anthropic_backend import AnthropicBackend
from workbench.agents.base import AgentBackend, AttemptContext, AttemptOutcome, TokenUsage
from workbench.agents.brief import render_brief, render_feedback
from workbench.agents.command_backend import CommandBackend
from workbench.agents.patch_backend import PatchBackend
from workbench.agents.runner import AgentRunResult, AttemptRecord, run_agent
from workbench.agents.selfcheck import SelfCheckReport, self_check

__all__ = [
    "AgentBackend", "AgentRunResult", "AnthropicBackend", "AttemptContext", "AttemptOutcome", "AttemptRecord",
    "CommandBackend", "PatchBackend", "SelfCheckReport", "TokenUsage", "render_brief", "render_feedback",
    "run_agent", "self_check",
]
