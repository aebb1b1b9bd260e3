"""The web UI through FastAPI's test client: queue, candidate page, plot, forms."""

from __future__ import annotations

import html
import re

import pytest
from fastapi.testclient import TestClient
from review_helpers import git

from workbench.results import read_result, write_result
from workbench.review import service
from workbench.review.web import create_app


@pytest.fixture()
def client(repo):
    store = repo.store()
    item, _ = service.submit_result(store, repo.accepted)
    app = create_app(store, repo.root, reviewer="web-reviewer")
    with TestClient(app) as c:
        c.item_id = item.id
        c.token = app.state.token
        c.store = store
        yield c


def test_queue_page_lists_the_candidate(client, repo):
    r = client.get("/")
    assert r.status_code == 200
    result = read_result(repo.accepted)
    assert f'href="/items/{client.item_id}"' in r.text
    assert result.candidate.branch in r.text
    assert '<td class="queued">queued</td>' in r.text
    assert client.get("/?state=merged").text.count('href="/items/') == 0


def test_candidate_page_shows_evidence_scope_perf_trace_and_reproduce(client, repo):
    result = read_result(repo.accepted)
    page = client.get(f"/items/{client.item_id}").text
    text = html.unescape(page)
    for v in result.verdicts:
        assert v.summary in text
        for e in v.evidence:
            assert e.name in text
    assert "<th>requests (ceil(T / query length))</th><td>1–64</td>" in page
    assert "<th>query length (Q)</th><td>1–8</td>" in page
    assert "<th>devices</th><td>cpu, cuda</td>" in page and "<td>float32</td>" in page
    for p in result.perf:
        assert f"<td>{p.name}</td>" in page and f"{p.speedup:.3f}x" in page
    assert f"{len(result.dispatch_trace)} decisions" in page
    assert "latency_specialized" in page
    assert result.command in text
    assert "is still at the judged base; the merge is clean" in page
    assert 'id="approve-form"' in page and client.token in page
    assert "No transcript" in page


def test_diff_lists_only_the_results_changed_paths(client, repo):
    result = read_result(repo.accepted)
    page = html.unescape(client.get(f"/items/{client.item_id}").text)
    diff = page[page.index('<pre id="diff">'):]
    diff = diff[:diff.index("</pre>")]
    files = re.findall(r"diff --git a/(\S+) b/", diff)
    assert files == list(result.candidate.changed_paths) == ["k3_model/kernels/moe_dispatch/__init__.py"]
    assert git(repo.root, "diff", "--name-only", f"{result.candidate.base_commit}..{result.candidate.candidate_commit}") \
        == "\n".join(result.candidate.changed_paths)
    assert "not judged by the guards" not in page


def test_diff_with_a_path_the_guards_did_not_judge_is_flagged(repo):
    """A result whose changed_paths omit a path in the diff (tampered or stale) gets a warning."""
    r = read_result(repo.accepted)
    hidden = r.model_copy(update={"result_id": r.result_id + "-h",
                                  "candidate": r.candidate.model_copy(update={"changed_paths": ("README.md",)})})
    store = repo.store()
    item, _ = service.submit_result(store, write_result(hidden, repo.accepted.parent))
    with TestClient(create_app(store, repo.root)) as c:
        page = html.unescape(c.get(f"/items/{item.id}").text)
    assert "The diff touches paths the guards did not judge: k3_model/kernels/moe_dispatch/__init__.py" in page


def test_speedup_plot_is_a_png(client):
    r = client.get(f"/items/{client.item_id}/speedup.png")
    assert r.status_code == 200
    assert r.headers["content-type"] == "image/png"
    assert r.content[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(r.content[16:20], "big"), int.from_bytes(r.content[20:24], "big")
    assert (width, height) == (640, 360)


def test_transcript_is_shown_when_it_exists(repo):
    r = read_result(repo.accepted)
    tpath = repo.root / ".workbench" / "transcripts" / "t1.txt"
    tpath.parent.mkdir(parents=True, exist_ok=True)
    tpath.write_text("agent: I fused the top-k and the <sort>.\n")
    with_t = r.model_copy(update={"result_id": r.result_id + "-t",
                                  "candidate": r.candidate.model_copy(update={"transcript_path": str(tpath)})})
    store = repo.store()
    item, _ = service.submit_result(store, write_result(with_t, repo.accepted.parent))
    with TestClient(create_app(store, repo.root)) as c:
        page = c.get(f"/items/{item.id}").text
    assert "agent: I fused the top-k and the &lt;sort&gt;." in page  # escaped, not markup


def test_approve_form_needs_the_token(client, repo):
    before = git(repo.root, "rev-parse", "main")
    r = client.post(f"/items/{client.item_id}/approve", data={"reviewer": "eve", "token": "forged"},
                    follow_redirects=False)
    assert r.status_code == 403
    assert git(repo.root, "rev-parse", "main") == before
    assert client.store.get(client.item_id).state == "queued"


def test_approve_form_merges(client, repo):
    r = client.post(f"/items/{client.item_id}/approve", data={"reviewer": "carol", "token": client.token})
    assert r.status_code == 200
    item = client.store.get(client.item_id)
    assert item.state == "merged"
    assert f"Merged into main as {item.merge_commit[:12]}." in r.text
    assert git(repo.root, "rev-parse", "main") == item.merge_commit
    assert item.transitions[-1].who == "carol"


def test_reject_form_records_reason_and_refusal_is_shown(client, repo):
    r = client.post(f"/items/{client.item_id}/reject", data={"reviewer": "dan", "reason": "", "token": client.token})
    assert "needs a reason" in html.unescape(r.text)
    r = client.post(f"/items/{client.item_id}/reject",
                    data={"reviewer": "dan", "reason": "grouped top-k path is untested at G=8", "token": client.token})
    item = client.store.get(client.item_id)
    assert (item.state, item.reason, item.transitions[-1].who) == ("rejected", "grouped top-k path is untested at G=8", "dan")
    assert '<span id="state" class="rejected">rejected</span>' in r.text
    assert 'id="approve-form"' not in r.text


def test_unknown_item_is_404(client):
    r = client.get("/items/999")
    assert r.status_code == 404
    assert "Review item 999 does not exist" in r.text
