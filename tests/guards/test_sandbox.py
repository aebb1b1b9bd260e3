"""Containment of the child that runs candidate code: secrets, identity, response channel, limits."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest

from guards import sandbox
from guards.sandbox import NONCE_BYTES, RESPONSE_MAGIC, _read_frame, drop_privileges_available, run_child
from tests.conftest import REPO_ROOT

KERNEL = "k3_model/kernels/moe_dispatch/__init__.py"


def _worktree(tmp_path: Path, kernel_source: str) -> Path:
    """A minimal candidate checkout: the project's k3_model and kernels plus one kernel module."""
    wt = tmp_path / "wt"
    for pkg in ("k3_model", "kernels"):
        shutil.copytree(REPO_ROOT / pkg, wt / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (wt / KERNEL).write_text(kernel_source)
    os.chmod(tmp_path, 0o755)
    return wt


def _request() -> dict:
    return {"mode": "correctness", "target": "k3_model.ops.moe_dispatch:moe_route_dispatch", "op": "moe_dispatch",
            "device": "cpu", "decode_backend": "latency_specialized", "cases": []}


def _run(wt: Path, timeout_s: float = 60):
    return run_child(wt, _request(), timeout_s=timeout_s, memory_bytes=8 * 2**30, device="cpu")


@pytest.mark.slow
def test_secrets_in_the_parent_environment_are_absent_in_the_child(tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", "sk-ant-test-canary")
    monkeypatch.setenv("GITHUB_TOKEN", "ghp-canary")
    monkeypatch.setenv("PYTHONPATH", "/nonexistent/injected")
    wt = _worktree(tmp_path, "import os\nraise RuntimeError('ENV=' + ','.join(sorted(os.environ)))\n")
    out = _run(wt)
    assert out.problem is None and out.response is not None
    err = out.response["error"]
    env = set(err.split("ENV=", 1)[1].split(".", 1)[0].split()[0].split(","))
    assert "HOME" in env and "PATH" in env  # the channel works: the child did report its environment
    assert not {"ANTHROPIC_API_KEY", "GITHUB_TOKEN", "PYTHONPATH"} & env
    assert "canary" not in err + out.stdout_tail + out.stderr_tail


@pytest.mark.slow
@pytest.mark.skipif(not drop_privileges_available(), reason="needs root and setpriv to run the child as another uid")
def test_child_runs_as_a_fresh_uid_and_cannot_write_the_worktree_or_repo(tmp_path):
    target = REPO_ROOT / ".workbench" / "results"
    src = (
        "import os, pathlib\n"
        "wrote = []\n"
        f"for p in [pathlib.Path(__file__).parent / 'x.py', pathlib.Path({str(target)!r}) / 'pwned.json', "
        f"pathlib.Path({str(REPO_ROOT / '.git')!r}) / 'pwned']:\n"
        "    try:\n"
        "        p.write_text('x'); wrote.append(str(p))\n"
        "    except OSError:\n"
        "        pass\n"
        "raise RuntimeError(f'UID={os.getuid()} WROTE={wrote}')\n"
    )
    wt = _worktree(tmp_path, src)
    out = _run(wt)
    err = out.response["error"]
    assert f"UID={out.uid} " in err and out.uid != 0
    assert "WROTE=[]" in err
    assert not (wt / "k3_model/kernels/moe_dispatch/x.py").exists()


def _frame(nonce: bytes, payload: bytes) -> bytes:
    return RESPONSE_MAGIC + nonce + struct.pack("<Q", len(payload)) + payload


def test_response_frame_needs_the_nonce_and_nothing_else():
    nonce = os.urandom(NONCE_BYTES)
    assert _read_frame(_frame(nonce, b"abc"), nonce) == (b"abc", None)
    payload, why = _read_frame(_frame(bytes(NONCE_BYTES), b"abc"), nonce)
    assert payload is None and "wrong nonce" in why
    payload, why = _read_frame(b'{"accepted": true}' + _frame(nonce, b"abc"), nonce)
    assert payload is None and "not a response frame" in why
    payload, why = _read_frame(_frame(nonce, b"abc") + b"forged", nonce)
    assert payload is None and "extra writes" in why
    assert _read_frame(b"", nonce) == (None, None)


@pytest.mark.slow
def test_printing_a_fake_response_does_not_forge_one(tmp_path):
    src = ("print('WBRESP1 ok True accepted'); import sys; sys.stdout.flush()\n"
           "from k3_model.dispatch import OpScope\nSCOPE = OpScope(devices=('cpu',))\n"
           "def moe_route_dispatch(*a, **k):\n    pass\n")
    out = _run(_worktree(tmp_path, src))
    assert out.response is not None and out.response["ok"] is True  # the real response, from the real channel
    assert out.response["scope"]["devices"] == ["cpu"] and "accepted" in out.stdout_tail


@pytest.mark.parametrize("src, needle", [
    ("import faulthandler\nfaulthandler._sigsegv()\n", "SIGSEGV"),  # ctypes is refused by the runtime hooks
    ("import os\nos._exit(7)\n", "status 7"),
    ("import time\ntime.sleep(60)\n", "s limit (wall clock)"),
    ("while True:\n    print('y' * 4095)\n", "output/file-size cap"),
])
def test_crash_hang_and_flood_come_back_as_one_line_problems(tmp_path, src, needle):
    out = _run(_worktree(tmp_path, src), timeout_s=8)
    assert out.response is None and needle in out.problem and "\n" not in out.problem
    assert out.duration_s < 30


def test_user_task_count_sees_this_process():
    assert sandbox._user_tasks(os.getuid()) >= 1


def test_timing_tampering_cross_check():
    from guards.perf import timing_tampering

    wall = [100.0] * 50
    honest_loaded = [60.0] * 50  # CPU clock under load: below the wall clock, equally on both sides
    assert timing_tampering(honest_loaded, wall, honest_loaded, wall, device="cpu") is None
    assert "tampering" in timing_tampering(honest_loaded, wall, [15.0] * 50, wall, device="cpu")
    assert "tampering" in timing_tampering([300.0] * 50, wall, [100.0] * 50, wall, device="cpu")
    assert timing_tampering([120.0] * 50, wall, [90.0] * 50, wall, device="cuda") is None
    assert "candidate samples are 0.10x" in timing_tampering([120.0] * 50, wall, [10.0] * 50, wall, device="cuda")
    assert timing_tampering([1.0], [], [1.0], [], device="cpu") is None  # too few readings: not judged


@pytest.mark.slow
def test_a_response_over_the_cap_is_named_as_such_and_never_blocks_the_child(monkeypatch):
    """The reader keeps draining past the cap: before, it stopped reading, the child blocked in its write
    until the wall-clock limit and the verdict said "exceeded its 300 s limit" with an empty stderr (the
    DSpark CUDA kernel's judging on the H200, session 9). Now the verdict names the response, at once."""
    import time

    from guards.cases import build_case
    from guards.correctness import scope_limits
    from workbench.taskspec import load_task

    task = load_task(REPO_ROOT, "k3_dspark_verify")
    case = build_case(task, task.workload("v4k_b8"), 1)
    req = {"mode": "correctness", "target": task.target, "op": task.op, "device": "cpu",
           "decode_backend": "latency_specialized", "scope_limits": scope_limits(task, "cpu", [1]),
           "cases": [{**case.request_entry(), "graph": False}]}
    full = run_child(REPO_ROOT, req, timeout_s=120, memory_bytes=task.timeouts.memory_bytes, device="cpu")
    assert full.problem is None and full.response["cases"][0]["calls"][0]["outputs"]
    # inputs come back as digests, not copies: the response stays near the size of the outputs
    after = full.response["cases"][0]["calls"][0]["inputs_after"]
    assert set(after) == set(task.inputs) and all(set(d) == {"shape", "dtype", "sha256"} for d in after.values())
    monkeypatch.setattr(sandbox, "MAX_RESPONSE_BYTES", 1024)
    t0 = time.monotonic()
    over = run_child(REPO_ROOT, req, timeout_s=120, memory_bytes=task.timeouts.memory_bytes, device="cpu")
    assert over.problem.startswith("child response exceeded 1024 bytes"), over.problem
    assert not over.timed_out and time.monotonic() - t0 < 0.5 * 120 + full.duration_s
    # a request that needs more says so: the cap is the larger of the two (KDA's state pools on CUDA, session 24)
    from guards.correctness import response_bytes

    need = response_bytes([case], 3)
    fits = run_child(REPO_ROOT, req, timeout_s=120, memory_bytes=task.timeouts.memory_bytes, device="cpu",
                     max_response_bytes=need)
    assert fits.problem is None
    outs = fits.response["cases"][0]["calls"][2]["outputs"]
    per_call = sum(t.numel() * t.element_size() for t in outs.values())
    assert per_call > 0 and need == 2 * 3 * per_call + 64 * 2**20  # every output of 3 calls, twice, + 64 MiB


@pytest.mark.slow
def test_a_scope_that_differs_between_processes_fails_the_child(tmp_path):
    """Every child that imports the candidate's kernel for a later guard (perf, model eval) is sent the scope the
    correctness run declared (``expect_scope``, ``guards.activation.scope_expectation``) and fails unless its
    own parse equals it: a SCOPE computed at import (from the process id, a random draw, the time) would
    otherwise be judged in one process and timed or served in another (session 24's red team, helper-27).
    Here the kernel's SCOPE is constant and the other process's parse is what the request says."""
    src = ("from k3_model.dispatch import OpScope\n"
           "SCOPE = OpScope(devices=('cpu',), phases=('decode',), requests_max=8)\n"
           "def moe_route_dispatch(*a, **k):\n    raise RuntimeError('never called')\n")
    wt = _worktree(tmp_path, src)
    first = _run(wt)
    declared = first.response["scope"]
    assert first.response["ok"] and declared["requests_max"] == 8
    same = run_child(wt, {**_request(), "expect_scope": declared}, timeout_s=60, memory_bytes=8 * 2**30, device="cpu")
    other = {**declared, "requests_max": 64}  # what a SCOPE drawn at import gave the correctness run
    drift = run_child(wt, {**_request(), "expect_scope": other}, timeout_s=60, memory_bytes=8 * 2**30, device="cpu")
    assert not drift.response["ok"], drift.response
    first_line = drift.response["error"].splitlines()[0]
    assert "differs from the one its correctness run declared" in first_line and "SCOPE must be constant" in first_line
    assert same.response["ok"], same.response["error"]


@pytest.mark.slow
def test_the_request_reaches_the_child_in_memory_and_its_fd_is_closed_before_candidate_code(tmp_path):
    """The request travels in a memfd the child reads (``guards.sandbox.child_session``): nothing of it is on disk
    in the child's home, and candidate code finds no open fd to it (it could seek back to the start). (Nor a
    mapping: candidate code may not read ``/proc/self/maps`` at all, see the test below; the fds are probed
    here with ``os.readlink``, which no audit event reports.)"""
    src = ("import os\n"
           "def _link(n):\n"
           "    try:\n"
           "        return os.readlink(f'/proc/self/fd/{n}')\n"
           "    except OSError:\n"
           "        return None\n"
           "fds = {n: _link(n) for n in range(256)}\n"
           "fds = {n: v for n, v in fds.items() if v is not None}\n"
           "home = sorted(os.listdir(os.environ['HOME']))\n"
           "raise RuntimeError(f'FDS={sorted(fds.values())} HOME={home} MAPS=[]')\n")
    out = _run(_worktree(tmp_path, src))
    assert out.problem is None and out.response is not None
    err = out.response["error"]
    import re

    m = re.search(r"FDS=(\[.*?\]) HOME=(\[.*?\]) MAPS=(\[.*?\])", err)
    assert m, err  # the candidate's report came back
    assert "pipe:" in m.group(1) and "memfd:" not in m.group(1), m.group(1)  # no fd to the request's memfd
    assert "request" not in m.group(2), m.group(2)  # nor a file in the child's home


_PROC_READS = {  # what candidate code tries -> whether the runtime hooks refuse it
    "maps": ("import io as _io\nwith _io.open('/pr' + 'oc/self/maps', 'rb') as _f:\n    _f.read(64)\n", True),
    "mem": ("import io as _io\nwith _io.open('/proc/self/mem', 'rb') as _f:\n    pass\n", True),
    "environ": ("import io as _io\nwith _io.open('/proc/self/environ', 'rb') as _f:\n    _f.read(64)\n", True),
    "status": ("import io as _io\nwith _io.open('/proc/self/status', 'rb') as _f:\n    _f.read(64)\n", True),
    "thread-self maps": ("import io as _io\nwith _io.open('/proc/thread-self/maps', 'rb') as _f:\n    _f.read(64)\n", True),
    "task tid maps": ("import os as _os\nwith open(f'/proc/self/task/{_os.getpid()}/maps', 'rb') as _f:\n    _f.read(64)\n", True),
    "fd listing": ("import os as _os\n_os.listdir('/pr' + 'oc/self/fd')\n", True),
    "dir fd": ("import os as _os\n_d = _os.open('/proc', _os.O_RDONLY)\n_os.open('self/maps', _os.O_RDONLY, dir_fd=_d)\n", True),
    "cpuinfo": ("import io as _io\nwith _io.open('/proc/cpuinfo', 'rb') as _f:\n    _f.read(64)\n", False),
}


@pytest.mark.slow
@pytest.mark.parametrize("what", list(_PROC_READS))
def test_candidate_code_may_not_read_its_own_proc_entries(what):
    """Session 26's red team: a kernel read ``/proc/self/maps`` (path built from pieces, past the audit),
    saw the perf child's call slots and did its work 4x in every other process; the review after it reached
    the same entries through ``/proc/thread-self``, ``/proc/self/task/<tid>`` and a folder fd. The runtime
    hooks refuse this process's ``/proc`` entries (``guards._child_hooks._proc_own``) and folder fds to
    candidate code; machine-wide entries (``/proc/cpuinfo``) stay readable."""
    from guards.judged_tree import judged_tree
    from guards.sandbox import run_child
    from tests.conftest import REPO_ROOT, git

    src, denied = _PROC_READS[what]
    head = git(REPO_ROOT, "rev-parse", "HEAD")
    with judged_tree(REPO_ROOT, head, "kernel-workbench") as tree:
        kernel = tree / "k3_model/kernels/moe_dispatch/__init__.py"
        kernel.write_text(kernel.read_text() + "\n" + src)
        req = {"mode": "correctness", "target": "k3_model.ops.moe_dispatch:moe_route_dispatch", "op": "moe_dispatch",
               "device": "cpu", "decode_backend": "latency_specialized", "cases": []}
        out = run_child(tree, req, timeout_s=60, memory_bytes=8 * 2**30, device="cpu")
    error = str((out.response or {}).get("error") or "")
    if denied:
        assert "HarnessDenied: " in error and ("/proc entries" in error or "folder" in error), error[-800:]
    else:
        assert out.response and out.response.get("ok") and not error, (out.problem, error[-800:])
