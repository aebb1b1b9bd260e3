"""Bad input to ``workbench review ...`` on a minimal checkout (no pipeline run): one clear line, exit 2,
nothing created; a review refused on its merits is exit 1 (issue 17 item 6)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from review_helpers import add_item, make_checkout
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
