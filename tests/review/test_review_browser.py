"""The review flow in a real headless browser: Debian's chromium driven by Playwright.

Skipped (with the reason) only when chromium or Playwright is missing on a developer machine; in
CI (``CI=true``) a missing browser is a failure, since ``.ci/install-browser.sh`` installs it.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import threading
import time

import pytest
from review_helpers import git

from workbench.results import file_sha256, read_result
from workbench.review import service
from workbench.review.web import create_app

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def _need_browser():
    missing = []
    if not (os.path.exists(CHROMIUM) or shutil.which("chromium")):
        missing.append(f"chromium ({CHROMIUM})")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing.append("the playwright Python package")
    if missing:
        why = f"needs {' and '.join(missing)}; install with bash .ci/install-browser.sh"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the browser test: {why}")
        pytest.skip(why)


@pytest.fixture()
def server(repo):
    import uvicorn

    store = repo.store()
    item, _ = service.submit_result(store, repo.accepted)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(store, repo.root, reviewer="browser-reviewer"),
                                        host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", store, item.id
    srv.should_exit = True
    th.join(timeout=10)


@pytest.mark.slow
def test_approve_in_browser_merges_with_evidence(repo, server):
    _need_browser()
    from playwright.sync_api import sync_playwright

    url, store, item_id = server
    result = read_result(repo.accepted)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM if os.path.exists(CHROMIUM) else shutil.which("chromium"),
                                     args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(url + "/")
            assert page.locator("#queue td.queued").inner_text() == "queued"
            page.click(f"a[href='/items/{item_id}']")
            assert page.locator("#state").inner_text() == "queued"
            assert page.locator("#verdicts tr").count() == 1 + len(result.verdicts)
            assert page.locator("#perf tr").count() == 1 + len(result.perf)
            assert page.locator("#diff-paths li").all_inner_texts() == list(result.candidate.changed_paths)
            assert page.locator("#reproduce").inner_text().strip() == result.command
            page.wait_for_function("() => { const i = document.querySelector('#speedup-plot');"
                                   " return i.complete && i.naturalWidth > 0 }", timeout=30_000)
            assert page.evaluate("() => document.querySelector('#speedup-plot').naturalWidth") == 640
            page.fill("#approve-form input[name=reviewer]", "Browser Reviewer")
            page.click("#approve")
            page.wait_for_selector("#state.merged")
            assert page.locator("#msg").inner_text().startswith("Merged into main as ")
            merge_sha = page.locator("#merge-commit").inner_text().strip()
        finally:
            browser.close()

    assert git(repo.root, "rev-parse", "main") == merge_sha
    assert git(repo.root, "rev-list", "--parents", "-n1", merge_sha).split()[2] == result.candidate.candidate_commit
    msg = git(repo.root, "log", "-1", "--format=%B", merge_sha)
    for v in result.verdicts:
        assert v.one_line() in msg
    assert f"Result-sha256: {file_sha256(repo.accepted)}" in msg
    assert "Approved by Browser Reviewer" in msg
    item = store.get(item_id)
    assert (item.state, item.merge_commit, item.transitions[-1].who) == ("merged", merge_sha, "Browser Reviewer")


def test_missing_browser_skips_locally_and_fails_in_ci(monkeypatch):
    mod = sys.modules[__name__]

    monkeypatch.setattr(mod, "CHROMIUM", "/nonexistent/chromium")
    monkeypatch.setattr(mod.shutil, "which", lambda name: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"CI must run the browser test: needs chromium \(/nonexistent/chromium\)"):
        mod._need_browser()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match=r"needs chromium .*install with bash .ci/install-browser.sh"):
        mod._need_browser()
