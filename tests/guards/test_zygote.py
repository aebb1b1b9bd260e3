"""The fork server of CPU guard children (guards/_zygote.py, guards/sandbox.py ``Zygote``): a forked child is
contained exactly as an exec'd one, and starts with torch imported."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from guards import sandbox
from guards.sandbox import drop_privileges_available, run_child
from tests.guards.test_sandbox import _request, _worktree

PROBE = r"""
import ctypes, json, os, resource, sys
status = {}
for line in open("/proc/self/status"):
    k, _, v = line.partition(":")
    if k in ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "SigBlk", "SigIgn",
             "SigCgt"):
        status[k] = v.split()
print(json.dumps({
    "status": status,
    "dumpable": ctypes.CDLL(None).prctl(3, 0, 0, 0, 0),
    "proc_owner": os.stat("/proc/self").st_uid,
    "umask": os.umask(0o22),
    "session_leader": os.getsid(0) == os.getpid() == os.getpgid(0),
    "rlimits": {n: resource.getrlimit(getattr(resource, n)) for n in ("RLIMIT_CORE", "RLIMIT_FSIZE", "RLIMIT_NPROC", "RLIMIT_AS")},
    "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "argv": sys.argv[1:],
    "isolated": sys.flags.isolated,
    "stdin": os.read(0, 10).decode(),
}))
"""


def _limits(uid):
    rl = {"RLIMIT_CORE": (0, 0), "RLIMIT_FSIZE": (sandbox.OUTPUT_CAP_BYTES,) * 2, "RLIMIT_AS": (8 * 2**30,) * 2}
    if uid is not None:
        rl["RLIMIT_NPROC"] = (sandbox.MAX_PROCESSES,) * 2
    return rl


def _exec_probe(script: Path, cwd: Path, env: dict, rl: dict, uid, fd: int) -> dict:
    import json
    import resource

    def limits():
        for n, v in rl.items():
            resource.setrlimit(getattr(resource, n), v)

    argv = [sys.executable, "-I", str(script), "x"]
    if uid is not None:  # the exec path's own command line (guards/sandbox.py child_session)
        argv = [*sandbox.setpriv_prefix(uid), *argv]
    p = subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, preexec_fn=limits,
                       start_new_session=True, pass_fds=(fd,), check=True)
    return json.loads(p.stdout)


def _fork_probe(script: Path, cwd: Path, env: dict, rl: dict, uid, fd: int, tmp: Path) -> dict:
    import json

    z = sandbox._zygote_for(env)
    with open(tmp / "out", "wb") as out, open(tmp / "err", "wb") as err:
        p = z.spawn([str(script), "x"], cwd=cwd, env=env, stdout=out.fileno(), stderr=err.fileno(), fds=(fd,),
                    rlimits=rl, uid=uid)
    assert p.wait(60) == 0, (tmp / "err").read_text()
    return json.loads((tmp / "out").read_text())


@pytest.mark.parametrize("sigint", ["as_started", "ignored"])
def test_a_forked_child_is_contained_exactly_as_an_exec_d_one(tmp_path, sigint):
    """Same uid, gid, groups, capability sets, no_new_privs, session, limits, open fds, folder, environment,
    signal dispositions and stdin as the exec path (``setpriv`` + ``preexec_fn``) gives, with or without the uid
    drop; also with SIGINT ignored in the judge after its fork server started, as in a judge started in the
    background of a non-interactive shell (session 28's rehearsal: exec'd children inherited the ignore, forked
    ones got Python's handler) or one that changed it since (helper-35)."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    os.chmod(tmp_path, 0o755)
    env = sandbox.scrubbed_env(tmp_path)
    if sigint == "ignored":  # the same fork server, started before SIGINT was ignored (as in a long-lived judge)
        _check_parity(script, tmp_path, env)
        before = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            _check_parity(script, tmp_path, env)
        finally:
            signal.signal(signal.SIGINT, before)
        return
    _check_parity(script, tmp_path, env)


def _check_parity(script: Path, tmp_path: Path, env: dict) -> None:
    uid = 654321 if drop_privileges_available() else None
    r, w = os.pipe()
    try:
        rl = _limits(uid)
        exec_d = _exec_probe(script, tmp_path, env, rl, uid, w)
        forked = _fork_probe(script, tmp_path, env, rl, uid, w, tmp_path)
    finally:
        os.close(r)
        os.close(w)
    assert forked == exec_d
    assert forked["fds"][:3] == [0, 1, 2] and w in forked["fds"] and forked["session_leader"]
    assert forked["dumpable"] == 1 and forked["proc_owner"] == (uid if uid is not None else os.geteuid())
    if uid is not None:
        assert forked["status"]["Uid"] == [str(uid)] * 4 and forked["status"]["CapEff"] == ["0000000000000004"]
        assert forked["status"]["CapAmb"] == ["0000000000000004"] and forked["status"]["NoNewPrivs"] == ["1"]


def test_children_fork_from_one_server_that_imported_torch(tmp_path):
    script = tmp_path / "who.py"
    script.write_text("import os, sys\nprint(os.getppid(), 'torch' in sys.modules, 'k3_model' in sys.modules)\n")
    env = sandbox.scrubbed_env(tmp_path)
    z = sandbox._zygote_for(env)
    seen = []
    for i in range(2):
        with open(tmp_path / f"out{i}", "wb") as out:
            p = z.spawn([str(script)], cwd=tmp_path, env=env, stdout=out.fileno(), stderr=out.fileno(), fds=(),
                        rlimits={}, uid=None)
        assert p.wait(60) == 0
        seen.append((tmp_path / f"out{i}").read_text().split())
    assert seen == [[str(z.proc.pid), "True", "False"]] * 2  # the worktree's code is never the server's
    assert sandbox._zygote_for({**env, "HOME": "/elsewhere", "TMPDIR": "/elsewhere"}) is z
    other = sandbox._zygote_for({**env, "OMP_NUM_THREADS": "2"})  # an environment torch reads at import: another
    assert other is not z


def test_fds_land_at_the_numbers_the_child_was_told_whatever_their_order(tmp_path):
    pipes = [os.pipe() for _ in range(5)]
    fds = tuple(w for _, w in reversed(pipes))  # numbers that the server's own copies may occupy
    script = tmp_path / "fds.py"
    script.write_text("import os, sys\nfor fd in map(int, sys.argv[1:]):\n    os.write(fd, str(fd).encode())\n")
    env = sandbox.scrubbed_env(tmp_path)
    with open(tmp_path / "err", "wb") as err:
        p = sandbox._zygote_for(env).spawn([str(script), *map(str, fds)], cwd=tmp_path, env=env, stdout=err.fileno(),
                                           stderr=err.fileno(), fds=fds, rlimits={}, uid=None)
    assert p.wait(60) == 0, (tmp_path / "err").read_text()
    for r, w in pipes:
        os.close(w)
        assert os.read(r, 64) == str(w).encode()
        os.close(r)


def test_a_dead_fork_server_is_replaced_and_its_orphans_count_as_killed(tmp_path):
    env = sandbox.scrubbed_env(tmp_path)
    z = sandbox._zygote_for(env)
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    p = z.spawn([str(script)], cwd=tmp_path, env=env, stdout=2, stderr=2, fds=(), rlimits={}, uid=None)
    z.proc.kill()
    z.proc.wait()
    assert p.wait(10) == -signal.SIGKILL  # its status was lost with the server: killed, never left running
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{p.pid}") and _state(p.pid) != "Z":
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{p.pid}") or _state(p.pid) == "Z"
    z2 = sandbox._zygote_for(env)
    assert z2 is not z and z2.proc.poll() is None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_a_judged_child_starts_as_the_setting_says(tmp_path, monkeypatch, start):
    """``WORKBENCH_CHILD_START``: ``fork`` (the default) starts CPU children from the fork server, ``exec``
    from this process; both run the candidate's code and answer."""
    monkeypatch.setenv("WORKBENCH_CHILD_START", start)
    wt = _worktree(tmp_path, "import os\nraise RuntimeError(f'PARENT={os.getppid()}=')\n")
    out = run_child(wt, _request(), timeout_s=120, memory_bytes=8 * 2**30, device="cpu")
    assert out.problem is None and out.response is not None, out
    parent = int(out.response["error"].split("PARENT=", 1)[1].split("=", 1)[0])
    if start == "fork":
        assert parent == sandbox._zygote_for(sandbox.scrubbed_env(Path("/x"))).proc.pid
    else:
        assert parent == os.getpid()


def test_a_setting_that_is_neither_fork_nor_exec_is_refused(monkeypatch):
    from workbench.envs import EnvVarError

    monkeypatch.setenv("WORKBENCH_CHILD_START", "spawn")
    with pytest.raises(EnvVarError, match="WORKBENCH_CHILD_START"):
        sandbox.forked_start("cpu", _request())
    monkeypatch.delenv("WORKBENCH_CHILD_START")
    assert sandbox.forked_start("cpu", {"mode": "perf"})
    assert not sandbox.forked_start("cuda", {"mode": "perf"})  # a GPU child is exec'd whatever the setting
    assert not sandbox.forked_start("cpu", {"mode": "model_eval_vllm"})  # vLLM's engine starts processes of its own


def test_warming_starts_the_fork_server_children_will_use(tmp_path, monkeypatch):
    monkeypatch.delenv("WORKBENCH_CHILD_START", raising=False)
    sandbox.close_zygotes()
    sandbox.warm_zygote("cuda")
    assert sandbox._zygotes == {}  # GPU children are exec'd: nothing to warm
    sandbox.warm_zygote("cpu")
    (z,) = sandbox._zygotes.values()
    assert sandbox._zygote_for(sandbox.scrubbed_env(tmp_path)) is z  # the one a child of any home gets


def test_a_zero_wait_is_a_poll_and_a_spawn_whose_parent_left_is_killed(tmp_path):
    """helper-34: ``wait(0)`` made the report socket non-blocking (BlockingIOError escaped as an interruption);
    and a child whose parent stopped waiting for its pid (Ctrl-C) ran on, untracked."""
    env = sandbox.scrubbed_env(tmp_path)
    z = sandbox._zygote_for(env)
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    p = z.spawn([str(script)], cwd=tmp_path, env=env, stdout=2, stderr=2, fds=(), rlimits={}, uid=None)
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.0)
    os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(10) == -signal.SIGKILL
    before = set(os.listdir("/proc"))
    import json
    import socket

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    spec = {"argv": [str(script)], "cwd": str(tmp_path), "env": env, "rlimits": {}, "uid": None, "fd_numbers": []}
    mine.close()  # the parent gave up before the server answered
    with open(os.devnull, "rb") as null:
        socket.send_fds(z.sock, [json.dumps(spec).encode()], [theirs.fileno(), null.fileno(), 2, 2])
    theirs.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in set(os.listdir("/proc")) - before if p.isdigit() and _state(int(p)) not in ("gone", "Z")
                 and str(script) in _cmdline(int(p))]
        if not alive:
            break
        time.sleep(0.05)
    assert not alive
    assert z.proc.poll() is None  # the server lives on
