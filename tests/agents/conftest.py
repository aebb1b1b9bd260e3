"""Fixtures for the agent tests: a private clone of the project copy per module, and a mock
HTTP transport for the real Anthropic SDK (no network).

The SDK (anthropic >= 2) sends requests through ``httpx2``; a plain ``httpx`` client is refused by its
constructor, so the mock transport is ``httpx2.MockTransport``.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

RECORDED = Path(__file__).with_name("recorded")


@pytest.fixture(scope="session")
def repo_template(pristine_repo) -> Path:
    """The session's git copy of the project without its merged kernels (the agents write a kernel as
    new; tests/conftest.py), cloned per module below."""
    return pristine_repo


@pytest.fixture(scope="module")
def repo(repo_template, tmp_path_factory) -> Path:
    """A private clone of the template (worktrees and branches of one test module stay there)."""
    d = tmp_path_factory.mktemp("repo") / "repo"
    subprocess.run(["git", "clone", "-q", str(repo_template), str(d)], check=True)
    return d


def recorded(name: str, **subst: str) -> list[dict[str, Any]]:
    """Load ``recorded/<name>.json`` (a list of {status, headers, body}); ``{{KEY}}`` strings in bodies
    are replaced by ``subst[KEY]`` (used to splice the good fixture's kernel into a write_file call)."""
    text = (RECORDED / f"{name}.json").read_text(encoding="utf-8")
    for k, v in subst.items():
        text = text.replace("{{" + k + "}}", json.dumps(v)[1:-1])
    return json.loads(text)


class MockAPI:
    """Serves recorded Messages API responses in order and keeps every request body."""

    def __init__(self, responses: list[dict[str, Any]]) -> None:
        self.responses = list(responses)
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []

    def handler(self, request):
        import httpx2

        self.requests.append(json.loads(request.content))
        self.headers.append(dict(request.headers))
        if not self.responses:
            return httpx2.Response(500, json={"type": "error", "error": {"type": "api_error", "message": "no more recorded responses"}})
        r = self.responses.pop(0)
        return httpx2.Response(r.get("status", 200), headers=r.get("headers", {}), json=r["body"])

    def client(self, max_retries: int = 2):
        import anthropic
        import httpx2

        return anthropic.Anthropic(api_key="sk-ant-test-not-a-key", max_retries=max_retries,
                                   http_client=httpx2.Client(transport=httpx2.MockTransport(self.handler)))


@pytest.fixture
def load_recorded():
    """:func:`recorded` as a fixture."""
    return recorded


@pytest.fixture
def mock_api():
    """Factory: ``mock_api(responses) -> MockAPI``."""
    return MockAPI
