"""Approval states what was not judged (issue 15 item 4): a result with SKIP verdicts is queued as
"accepted, not judged", ``review list``/``show`` and the web UI say so, and approval needs
``--accept-unjudged "REASON"``, which goes into the merge commit. On a minimal checkout with a real
candidate commit (no pipeline run)."""

from __future__ import annotations

import html

import pytest
from fastapi.testclient import TestClient
from review_helpers import SKIPS, candidate_result, git, make_checkout
from typer.testing import CliRunner

from workbench.cli import app
from workbench.review import service
from workbench.review.web import create_app

runner = CliRunner()
REASON = "allreduce is timed on cuda only; H200 run in bench/results/h200 shows 1.4x"


@pytest.fixture()
def checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("WORKBENCH_DB", raising=False)
    root = make_checkout(tmp_path / "repo")
    git(root, "config", "user.name", "Rita Reviewer")
    return root


def invoke(root, *args):
    return runner.invoke(app, [*args, "--repo", str(root)], env={"COLUMNS": "250", "WORKBENCH_DB": ""})


def submitted(root, **kw):
    path = candidate_result(root, **kw)
    out = invoke(root, "review", "submit", str(path))
    assert out.exit_code == 0, out.output
    return path


def test_approve_refuses_an_unjudged_candidate_without_the_flag(checkout):
    """The issue's "done when": no --accept-unjudged, no merge; one line, exit 1, the item still queued."""
    submitted(checkout)
    main_before = git(checkout, "rev-parse", "main")
    out = invoke(checkout, "review", "approve", "1")
    assert out.exit_code == 1, out.output
    line = out.stderr.strip()
    assert "\n" not in line
    assert line.startswith("error: Review item #1 was accepted, not judged: model_eval SKIP (K3-mini never calls op "
                           "'allreduce_rmsnorm'")
    assert "; perf SKIP (Performance of this task is judged on cuda only, not cpu" in line
    assert line.endswith('Approving it needs a reason for merging it unjudged (`workbench review approve ID '
                         '--accept-unjudged "REASON"`, or the web form\'s "accept unjudged" reason); nothing was merged.')
    assert git(checkout, "rev-parse", "main") == main_before
    item = service.open_store(checkout).get(1)
    assert item.state == "queued" and item.merge_commit is None
    assert [t.to_state for t in item.transitions] == ["queued"]
    # a blank reason is bad input (exit 2), like reject's; still nothing merged
    out = invoke(checkout, "review", "approve", "1", "--accept-unjudged", "   ")
    assert out.exit_code == 2 and "Approving review item #1 unjudged needs a reason" in out.stderr
    assert git(checkout, "rev-parse", "main") == main_before
    assert service.open_store(checkout).get(1).state == "queued"


def test_approve_with_a_reason_merges_and_the_commit_carries_it(checkout):
    path = submitted(checkout)
    out = invoke(checkout, "review", "approve", "1", "--accept-unjudged", REASON)
    assert out.exit_code == 0, out.output
    head = git(checkout, "rev-parse", "main")
    assert out.stdout.strip() == f"#1 merged into main as {head}"
    msg = git(checkout, "log", "-1", "--format=%B", "main")
    assert "Approved by Rita Reviewer; accepted, not judged: model_eval, perf by the workbench guards on cpu." in msg
    assert f"Not judged (SKIP), merged on Rita Reviewer's reason: {REASON}\n  model_eval: {SKIPS['model_eval']}\n" \
           f"  perf: {SKIPS['perf']}" in msg
    assert msg.rstrip().endswith(f"Accepted-unjudged: model_eval, perf\nAccepted-unjudged-reason: {REASON}")
    assert f"Result-sha256: {service.file_sha256(path)}" in msg
    item = service.open_store(checkout).get(1)
    assert [t.to_state for t in item.transitions] == ["queued", "approved", "merged"]
    assert item.transitions[1].note.endswith(f"; accepted unjudged (model_eval, perf): {REASON}")


def test_perf_only_skip_names_only_perf(checkout):
    submitted(checkout, skipped=("perf",))
    out = invoke(checkout, "review", "approve", "1")
    assert out.exit_code == 1
    assert "was accepted, not judged: perf SKIP (Performance of this task" in out.stderr
    assert "model_eval" not in out.stderr


def test_a_reason_for_a_fully_judged_candidate_is_bad_input(checkout):
    submitted(checkout, skipped=())
    main_before = git(checkout, "rev-parse", "main")
    out = invoke(checkout, "review", "approve", "1", "--accept-unjudged", "just in case")
    assert out.exit_code == 2, out.output
    assert out.stderr.strip() == ("error: Review item #1: an accept-unjudged reason was given, but every guard judged "
                                  "this result (no SKIP verdict); approve it without --accept-unjudged.")
    assert git(checkout, "rev-parse", "main") == main_before
    ok = invoke(checkout, "review", "approve", "1")
    assert ok.exit_code == 0, ok.output
    msg = git(checkout, "log", "-1", "--format=%B", "main")
    assert "Approved by Rita Reviewer; accepted by the workbench guards on cpu." in msg
    assert "Accepted-unjudged" not in msg and "Not judged" not in msg


def test_list_and_show_say_what_was_not_judged(checkout):
    submitted(checkout, n=9)
    submitted(checkout, skipped=(), n=10)
    listing = invoke(checkout, "review", "list")
    assert listing.exit_code == 0
    rows = {ln.split("│")[1].strip(): ln for ln in listing.stdout.splitlines() if ln.startswith("│") and "wb/" in ln}
    assert "accepted, not judged: model_eval, perf" in rows["1"]
    assert "not judged" not in rows["2"] and "│ accepted " in rows["2"]
    shown = invoke(checkout, "review", "show", "1")
    assert shown.exit_code == 0  # show only reads: exit 0 whatever the verdicts
    banner = next(ln for ln in shown.stdout.splitlines() if ln.startswith("Accepted, NOT JUDGED"))
    assert banner == (f"Accepted, NOT JUDGED: model_eval ({SKIPS['model_eval'].rstrip('.')}); perf "
                      f"({SKIPS['perf'].rstrip('.')}). Approval needs a reason for merging it unjudged "
                      '(`workbench review approve ID --accept-unjudged "REASON"`, or the web form\'s "accept '
                      'unjudged" reason); the reason goes into the merge commit.')
    full = invoke(checkout, "review", "show", "2").stdout
    assert "judged: accepted (every guard judged it)" in full and "NOT JUDGED" not in full


def test_list_survives_a_result_file_that_changed(checkout):
    path = submitted(checkout)
    path.write_text(path.read_text().replace('"duration_s": 1.0', '"duration_s": 2.0'))
    listing = invoke(checkout, "review", "list")
    assert listing.exit_code == 0 and "result file changed since submission" in listing.stdout


def test_run_queues_a_perf_not_judged_result_as_not_judged(checkout, monkeypatch):
    """The run hook used to leave a "correct, perf not judged" result out of the queue; it now queues it,
    says what approval needs, and keeps exit 3."""
    import workbench.pipeline as pipeline
    from workbench.results import read_result

    path = candidate_result(checkout, skipped=("perf",))
    result = read_result(path)
    monkeypatch.setattr(pipeline, "run_candidate", lambda *a, **k: (result, path))
    out = invoke(checkout, "run", "k3_moe_dispatch", "-c", "x")
    assert out.exit_code == 3, out.output
    assert ('review queue: queued as #1, accepted, not judged: perf: approving it needs --accept-unjudged "REASON" '
            "(workbench review show 1)") in out.stderr
    assert [it.state for it in service.open_store(checkout).items()] == ["queued"]


@pytest.fixture()
def site(checkout):
    store = service.open_store(checkout)
    application = create_app(store, checkout, reviewer="web-reviewer")
    with TestClient(application) as c:
        c.store, c.root, c.token = store, checkout, application.state.token
        yield c


def test_web_banner_queue_column_and_the_approve_form_needs_a_reason(site):
    submitted(site.root)
    queue = site.get("/").text
    assert '<td class="judged not-judged">accepted, not judged: model_eval, perf</td>' in queue
    page = site.get("/items/1").text
    assert '<div id="unjudged" class="unjudged"><strong>Accepted, not judged:</strong> ' in page
    assert html.unescape(page).count(f"({SKIPS['perf']})") == 1
    assert 'name="accept_unjudged"' in page and "Approve and merge into main unjudged" in page
    main_before = git(site.root, "rev-parse", "main")
    for data in ({}, {"accept_unjudged": "  "}):  # no field, a blank field: refused, nothing merged
        r = site.post("/items/1/approve", data={"reviewer": "wendy", "token": site.token, **data})
        assert r.status_code == 200
        assert "was accepted, not judged: model_eval SKIP" in html.unescape(r.text)
        assert git(site.root, "rev-parse", "main") == main_before
        assert site.store.get(1).state == "queued"
    r = site.post("/items/1/approve", data={"reviewer": "wendy", "token": site.token, "accept_unjudged": REASON})
    assert r.status_code == 200 and "Merged into main as" in r.text
    assert git(site.root, "log", "-1", "--format=%B", "main").rstrip().endswith(f"Accepted-unjudged-reason: {REASON}")


def test_web_fully_judged_candidate_has_no_banner_or_reason_field(site):
    submitted(site.root, skipped=())
    assert '<td class="judged">accepted</td>' in site.get("/").text
    page = site.get("/items/1").text
    assert 'id="unjudged"' not in page and 'name="accept_unjudged"' not in page


def test_a_fixture_judged_on_a_fixture_base_is_never_queued(checkout):
    """A fixture judged with the merged kernel set aside was compared with the standard path, not with what
    main runs: ``review submit`` refuses it (exit 2, one line naming why) and the queue stays empty."""
    why = "the moe_dispatch kernel merged at 0123456789 (1 file(s)) is set aside"
    path = candidate_result(checkout, skipped=(), set_aside=why)
    out = invoke(checkout, "review", "submit", str(path))
    assert out.exit_code == 2, out.output  # refused like a rejected result
    assert f"judged a fixture on a fixture base ({why}); its baseline is not what main runs" in out.stderr
    assert service.open_store(checkout).items() == []
