"""The judge's children import candidate code from a plain clone, not the workbench's worktree
(guards/judged_tree.py): session 10's red team recognised the judge by its worktree's ``.git`` file."""

from __future__ import annotations

import pytest

from guards.judged_tree import judged_tree
from tests.conftest import REPO_ROOT, git


def test_the_judged_tree_is_a_plain_checkout_on_main_and_goes_away(tmp_path):
    head = git(REPO_ROOT, "rev-parse", "HEAD")
    with judged_tree(REPO_ROOT, head, "kernel-workbench") as tree:
        assert tree.name == "kernel-workbench" and ".workbench" not in str(tree)
        assert (tree / ".git").is_dir()  # a git worktree's .git is a file
        assert (tree / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"
        assert git(tree, "rev-parse", "HEAD") == head
        assert git(tree, "remote") == ""  # nothing names the worktree it came from
        assert (tree / "k3_model" / "ops" / "moe_dispatch.py").is_file()
        assert oct(tree.parent.stat().st_mode & 0o777) == "0o755"  # the child's uid reaches it
    assert not tree.parent.exists()


def test_an_unknown_commit_is_a_clear_error():
    with pytest.raises(RuntimeError, match="Making the judged tree failed: git -C"):
        with judged_tree(REPO_ROOT, "0" * 40, "x"):
            pass


@pytest.mark.slow
def test_a_child_may_not_read_its_checkouts_git_metadata(tmp_path):
    """The runtime hooks refuse reads under ``<root>/.git`` (where the checkout came from, its branch)."""
    from guards.sandbox import run_child

    head = git(REPO_ROOT, "rev-parse", "HEAD")
    with judged_tree(REPO_ROOT, head, "kernel-workbench") as tree:
        kernel = tree / "k3_model/kernels/moe_dispatch/__init__.py"
        kernel.write_text(kernel.read_text() + "\nwith open(__import__('os').path.join("
                          "__import__('os').path.dirname(__file__), '../../../.git/config')) as _f:\n    _f.read()\n")
        req = {"mode": "correctness", "target": "k3_model.ops.moe_dispatch:moe_route_dispatch", "op": "moe_dispatch",
               "device": "cpu", "decode_backend": "latency_specialized", "cases": []}
        out = run_child(tree, req, timeout_s=60, memory_bytes=8 * 2**30, device="cpu")
    error = str((out.response or {}).get("error", ""))
    assert "HarnessDenied: reading " in error and "/.git/config (the checkout's git metadata)" in error, error[-800:]
