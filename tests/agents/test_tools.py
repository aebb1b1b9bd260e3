"""The API agent's file tools: writes confined to the allowed paths, no escape through '..' or symlinks."""

from __future__ import annotations

import os

import pytest

from workbench.agents.tools import FileTools, ToolRefused
from workbench.taskspec import load_task
from workbench.worktree import create_agent_worktree

KDIR = "k3_model/kernels/moe_dispatch"


@pytest.fixture
def tools(repo):
    awt = create_agent_worktree(repo, "k3_moe_dispatch")
    return FileTools(awt.worktree, load_task(repo, "k3_moe_dispatch"))


def test_write_inside_allowed_paths(tools):
    assert tools.write_file(f"{KDIR}/sub/fused.py", "A = 1\n") == f"wrote 6 bytes to {KDIR}/sub/fused.py"
    assert (tools.worktree / KDIR / "sub/fused.py").read_text() == "A = 1\n"
    assert tools.write_file(f"./{KDIR}/b.py", "B = 2\n").endswith(f"{KDIR}/b.py")


@pytest.mark.parametrize("path, why", [
    ("k3_model/ops/moe_dispatch.py", "outside allowed_paths"),
    ("tests/test_evil.py", "always forbidden"),
    (f"{KDIR}/conftest.py", "always forbidden"),
    (f"{KDIR}/evil.pth", "always forbidden"),
    (f"{KDIR}/../../ops/moe_dispatch.py", "'..'"),
    ("/etc/passwd", "absolute"),
    (".git/config", "inside .git"),
    ("", "empty"),
])
def test_write_refused(tools, path, why):
    before = (tools.worktree / "k3_model/ops/moe_dispatch.py").read_text()
    with pytest.raises(ToolRefused, match=why if why != "'..'" else r"'\.\.'"):
        tools.write_file(path, "x = 1\n")
    assert (tools.worktree / "k3_model/ops/moe_dispatch.py").read_text() == before
    assert not (tools.worktree / "tests/test_evil.py").exists()


def test_write_through_symlinks_refused(tools, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, tools.worktree / KDIR / "link_dir")
    with pytest.raises(ToolRefused, match="is a symlink"):
        tools.write_file(f"{KDIR}/link_dir/x.py", "x = 1\n")
    assert not (outside / "x.py").exists()
    target = tools.worktree / "k3_model/ops/moe_dispatch.py"
    before = target.read_text()
    os.symlink("../../ops/moe_dispatch.py", tools.worktree / KDIR / "link_file.py")
    with pytest.raises(ToolRefused, match="is a symlink"):
        tools.write_file(f"{KDIR}/link_file.py", "hacked = 1\n")
    assert target.read_text() == before


def test_read_confined_to_worktree(tools, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not read")
    os.symlink(secret, tools.worktree / KDIR / "peek.txt")
    with pytest.raises(ToolRefused, match="outside the repository"):
        tools.read_file(f"{KDIR}/peek.txt")
    with pytest.raises(ToolRefused, match=r"'\.\.'"):
        tools.read_file("../../../README.md")
    with pytest.raises(ToolRefused, match="not a file"):
        tools.read_file("k3_model/nope.py")
    text = tools.read_file("k3_model/ops/moe_dispatch.py")
    assert text == (tools.worktree / "k3_model/ops/moe_dispatch.py").read_text()[:60_000]
    assert tools.read_file("k3_model/ops/moe_dispatch.py", offset=10) == text[10:]


def test_list_files(tools):
    tools.write_file(f"{KDIR}/new.py", "N = 1\n")
    listing = tools.list_files(KDIR).splitlines()
    assert listing == [f"{KDIR}/README.md", f"{KDIR}/new.py"]
    assert tools.list_files("k3_model/nothing_here") == "(no files under k3_model/nothing_here)"
