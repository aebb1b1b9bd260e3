"""Web UI pages on a minimal checkout (no pipeline run): HTML error pages, the queue's reasons, no empty
plot (issue 17 item 6.6)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from review_helpers import add_item, make_checkout, no_perf_result

from workbench.results import file_sha256
from workbench.review import service
from workbench.review.web import create_app


@pytest.fixture()
def site(tmp_path, monkeypatch):
    monkeypatch.delenv("WORKBENCH_DB", raising=False)
    root = make_checkout(tmp_path / "repo")
    store = service.open_store(root)
    with TestClient(create_app(store, root, reviewer="web-reviewer")) as c:
        c.store, c.root = store, root
        yield c


@pytest.mark.parametrize("path, detail", [
    ("/items/999", "Review item 999 does not exist in sqlite:///"),
    ("/items/abc", "There is no candidate &#39;abc&#39;: queue ids are numbers"),
    ("/no/such/page", "There is no page /no/such/page; the queue lists every candidate."),
])
def test_unknown_candidate_or_page_is_an_html_404(site, path, detail):
    r = site.get(path)
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("text/html")
    assert '<h1 id="error-status">404 Not Found</h1>' in r.text and detail in r.text
    assert '<a href="/">' in r.text


def test_queue_shows_the_reason_of_a_rejected_candidate(site):
    add_item(site.store, 2)
    service.reject(site.store, 2, reviewer="dan", reason="grouped top-k path is untested at G=8")
    r = site.get("/")
    assert r.status_code == 200
    assert "<th>reason</th>" in r.text
    assert '<td class="reason">grouped top-k path is untested at G=8</td>' in r.text
    assert r.text.count('<td class="reason"></td>') == 1  # the queued one has none


def test_no_plot_under_no_perf_rows(site, tmp_path):
    path = no_perf_result(tmp_path / "results")
    item, _ = site.store.add(result_id="r", result_path=str(path), result_sha256=file_sha256(path),
                             task_id="k3_moe_dispatch", branch="wb/k3_moe_dispatch/9", base_commit="b" * 40,
                             candidate_commit="c" * 40, target_branch="main", who="test")
    r = site.get(f"/items/{item.id}")
    assert r.status_code == 200
    assert '<p id="no-perf">No perf rows in this result.</p>' in r.text
    assert 'id="speedup-plot"' not in r.text and "speedup.png" not in r.text
