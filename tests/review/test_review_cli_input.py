"""Bad input to ``workbench review ...`` on a minimal checkout (no pipeline run): one clear line, exit 2,
nothing created; a review refused on its merits is exit 1 (issue 17 item 6)."""

from __future__ import annotations

import pytest
from review_helpers import add_item, make_checkout
from typer.testing import CliRunner

from workbench.cli import app
from workbench.review.service import open_store

runner = CliRunner()


@pytest.fixture()
def checkout(tmp_path, monkeypatch):
    monkeypatch.delenv("WORKBENCH_DB", raising=False)
    return make_checkout(tmp_path / "repo")


def invoke(root, *args):
    return runner.invoke(app, [*args, "--repo", str(root)], env={"COLUMNS": "250", "WORKBENCH_DB": ""})


@pytest.mark.parametrize("args", [["show", "7"], ["approve", "7"], ["reject", "7", "--reason", "x"]])
def test_unknown_id_exits_2_in_every_subcommand(checkout, args):
    """approve and reject used to exit 1 on an unknown id, show 2: bad input is 2 everywhere."""
    add_item(open_store(checkout))
    out = invoke(checkout, "review", *args)
    assert out.exit_code == 2, out.output
    line = out.stderr.strip()
    assert line.startswith("error: Review item 7 does not exist in sqlite:///") and "\n" not in line


def test_empty_reason_and_bad_store_exit_2_but_a_refusal_exits_1(checkout):
    add_item(open_store(checkout))
    out = invoke(checkout, "review", "reject", "1", "--reason", "  ")
    assert out.exit_code == 2 and "needs a reason" in out.stderr
    out = runner.invoke(app, ["review", "approve", "1", "--db", "bogus://", "--repo", str(checkout)])
    assert out.exit_code == 2 and "cannot open it" in out.stderr
    assert invoke(checkout, "review", "reject", "1", "--reason", "no").exit_code == 0
    out = invoke(checkout, "review", "approve", "1")  # refused on its merits: the item is rejected
    assert out.exit_code == 1 and "Review item #1 is rejected (no); only queued items can be approved." in out.stderr
    out = invoke(checkout, "review", "reject", "1", "--reason", "again")
    assert out.exit_code == 1 and "already rejected" in out.stderr


def test_a_git_repo_that_is_not_a_checkout_gets_no_queue(tmp_path):
    """Item 6.2: `review list` in some other git repository used to create .workbench/queue.db there."""
    from review_helpers import git

    other = tmp_path / "other"
    other.mkdir()
    (other / "f").write_text("x")
    git(other, "init", "-q")
    git(other, "add", "f")
    git(other, "commit", "-qm", "x")
    for args in (["list"], ["show", "1"], ["approve", "1"]):
        out = invoke(other, "review", *args)
        assert out.exit_code == 2, out.output
        assert "is a git repository but not a kernel-workbench checkout" in out.stderr
    assert not (other / ".workbench").exists()


def test_a_mistyped_db_path_is_refused_and_nothing_is_created(checkout, tmp_path):
    no_folder = tmp_path / "nosuch" / "queue.db"
    out = invoke(checkout, "review", "list", "--db", f"sqlite:///{no_folder}")
    assert out.exit_code == 2
    assert out.stderr.strip() == (f"error: Review store 'sqlite:///{no_folder}': folder {no_folder.parent} does not "
                                  "exist; check the --db path (or $WORKBENCH_DB), or create the folder first.")
    assert not no_folder.parent.exists()
    typo = tmp_path / "queu.db"
    for args in (["list"], ["show", "1"], ["approve", "1"], ["reject", "1", "--reason", "x"]):
        out = invoke(checkout, "review", *args, "--db", f"sqlite:///{typo}")
        assert out.exit_code == 2, out.output
        assert f"{typo} does not exist and this command only works on an existing queue" in out.stderr
    assert not typo.exists()


def test_an_existing_queue_given_by_db_or_env_keeps_working(checkout, tmp_path):
    from workbench.review.store import ReviewStore

    db = f"sqlite:///{tmp_path / 'team.db'}"
    add_item(ReviewStore(db), 2)
    out = invoke(checkout, "review", "reject", "1", "--reason", "untested at batch 33", "--db", db)
    assert out.exit_code == 0 and out.stdout.strip() == "#1 rejected: untested at batch 33"
    out = runner.invoke(app, ["review", "list", "--repo", str(checkout)], env={"COLUMNS": "250", "WORKBENCH_DB": db})
    assert out.exit_code == 0 and "review queue (2)" in out.stdout and "untested at batch 33" in out.stdout
    assert not (checkout / ".workbench").exists()  # the default queue was not touched


def test_the_default_queue_is_made_on_first_use(checkout):
    out = invoke(checkout, "review", "list")
    assert out.exit_code == 0 and "review queue (0)" in out.stdout
    assert "The queue is empty" in out.stdout and "never queued" in out.stdout  # what fills it (helper-22)
    assert (checkout / ".workbench" / "queue.db").is_file()


def test_ui_on_a_taken_port_is_a_clear_error_before_any_serving_line(checkout, monkeypatch):
    """Item 6.5: the port is bound first; a taken one is exit 2 and the server never starts."""
    import socket

    import uvicorn

    started = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: started.append(sockets))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = invoke(checkout, "ui", "--port", str(port))
    assert out.exit_code == 2, out.output
    assert out.stderr.strip() == (f"error: workbench ui: cannot listen on 127.0.0.1:{port} (it is already in use); "
                                  "pick a free port with --port N, or stop the program using it.")
    assert "review UI on" not in out.stdout and started == []


def test_ui_hands_its_bound_socket_to_the_server(checkout, monkeypatch):
    import socket

    import uvicorn

    seen = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: seen.append(
        [s.getsockname()[1] for s in sockets]))
    with socket.socket() as probe:  # a port free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    out = invoke(checkout, "ui", "--port", str(port))
    assert out.exit_code == 0, out.output
    assert out.stdout.startswith(f"review UI on http://127.0.0.1:{port}/ (queue sqlite:///")
    assert seen == [[port]]
