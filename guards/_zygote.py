"""The fork server of CPU guard children: imports torch once, then forks a contained child per request.

An exec'd child spends about 1.8 s of its life importing (97% of an empty correctness child on the 2-core CI
machine, torch about two thirds: session 26, by hand); a child forked from this process starts with torch,
numpy and pydantic already imported and runs ``guards/_child_main.py`` in place (``runpy``), so only the
candidate's worktree (``k3_model``, ``kernels``) is imported per child. Nothing of the worktree is ever
imported here, and no torch op runs here (no thread pool exists to be lost in a fork).

Started by ``guards/sandbox.py`` (:class:`Zygote`) as ``python -I _zygote.py <control fd>`` with the child's
environment (less HOME, TMPDIR and TRITON_CACHE_DIR); runs as the workbench's own user (root on CI).

Protocol (a ``SOCK_SEQPACKET`` socket, one message per request): the parent sends a JSON header with the
request's fds attached (``socket.send_fds``): first the parent's end of a fresh per-child socket pair, then
the child's stdin, stdout and stderr, then the fds the child must hold at the numbers the header names.
The zygote forks; the child sets itself up (:func:`_become_child`) exactly as the exec path's ``setpriv`` and
``preexec_fn`` do: new session, fds at their numbers and every other fd closed, working folder,
environment, resource limits, then the fresh uid with only ``CAP_DAC_READ_SEARCH`` and ``no_new_privs``.
The zygote writes ``pid <n>`` to the per-child socket, and ``exit <returncode>`` (negative: the signal)
once it has reaped the child. The control socket's end of file (the parent exited) ends the zygote.

Source: capabilities(7) (permitted, effective, inheritable, ambient and bounding sets; PR_SET_KEEPCAPS
across setuid), prctl(2), capset(2) (``_LINUX_CAPABILITY_VERSION_3``), util-linux setpriv(1) (what the exec
path runs).
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import selectors
import signal
import socket
import sys
import traceback

PRELOAD = ("torch", "numpy", "pydantic")
"""Site packages imported once here (never the worktree's code): the bulk of a child's start."""
MAX_FDS = 32
"""Most fds one spawn message carries."""
CAP_DAC_READ_SEARCH = 2  # linux/capability.h
_PR_SET_DUMPABLE, _PR_SET_KEEPCAPS, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 4, 8, 24, 38  # linux/prctl.h
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 47, 2
_CAP_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_privileges(uid: int) -> None:
    """Become ``uid``/gid ``uid`` with no supplementary groups, keeping only ``CAP_DAC_READ_SEARCH``
    (permitted, effective, inheritable and ambient; the bounding set holds it alone) and ``no_new_privs``:
    the state ``setpriv --reuid --regid --clear-groups --inh-caps --ambient-caps --bounding-set
    --no-new-privs`` leaves a program it execs in (``guards/sandbox.py``).

    Raises:
        OSError: a step was refused (the caller is not root, or the kernel lacks ambient capabilities).
    """
    libc = ctypes.CDLL(None, use_errno=True)

    def call(what: str, rc: int) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        if cap != CAP_DAC_READ_SEARCH:
            call(f"PR_CAPBSET_DROP {cap}", libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0))
    call("PR_SET_KEEPCAPS", libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    bit = 1 << CAP_DAC_READ_SEARCH
    hdr, data = _CapHeader(_CAP_VERSION_3, 0), (_CapData * 2)()
    data[0].effective = data[0].permitted = data[0].inheritable = bit
    call("capset", libc.capset(ctypes.byref(hdr), ctypes.byref(data)))
    call("PR_CAP_AMBIENT_RAISE", libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, CAP_DAC_READ_SEARCH, 0, 0))
    call("PR_SET_KEEPCAPS 0", libc.prctl(_PR_SET_KEEPCAPS, 0, 0, 0, 0))
    call("PR_SET_NO_NEW_PRIVS", libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0))
    # a uid change without an exec leaves the process non-dumpable (its /proc entries root's); an exec'd child of
    # setpriv is dumpable, owned by its uid: the same here (core dumps stay off: RLIMIT_CORE 0)
    call("PR_SET_DUMPABLE", libc.prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0))


def _place_fds(wanted: dict[int, int]) -> None:
    """Put each fd ``wanted[target]`` at number ``target`` (inheritable, as ``Popen``'s ``pass_fds``) and close
    every other fd of the process."""
    floor = max(wanted) + 1  # the copies sit above every target number, so no dup2 overwrites one
    high = {t: fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for t, fd in wanted.items()}
    for t in sorted(high):
        os.dup2(high[t], t, inheritable=True)
    keep = sorted(wanted)
    lo = 0
    for t in keep:
        if lo < t:  # os.closerange(n, n) closes every fd from n on (CPython passes high - 1 to close_range)
            os.closerange(lo, t)
        lo = t + 1
    os.closerange(lo, max(1 << 20, os.sysconf("SC_OPEN_MAX")))


def _become_child(spec: dict, fds: list[int], ready: int) -> None:
    """In the forked child: the containment of the exec path, then ``_child_main`` in place. Never returns.
    ``ready`` is closed once the child leads its own session (the server reports its pid only then)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        # the dispositions an exec'd child starts with: ignored where the judge ignores the signal at this spawn
        # (spec "ignored_signals"; e.g. SIGINT in a judge started in the background of a non-interactive shell,
        # session 28's rehearsal), else Python's SIGINT handler and the default for SIGTERM and SIGCHLD. SIGPIPE
        # and SIGXFSZ stay ignored, as Python sets them at start in an exec'd child (a write to a closed pipe
        # raises BrokenPipeError; past RLIMIT_FSIZE a write fails with EFBIG)
        ignored = set(spec.get("ignored_signals", ()))
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, signal.SIG_IGN if int(sig) in ignored else default)
        os.setsid()
        os.close(ready)
        stdin, stdout, stderr, *passed = fds
        _place_fds({0: stdin, 1: stdout, 2: stderr, **dict(zip(spec["fd_numbers"], passed))})
        os.chdir(spec["cwd"])
        os.environ.clear()
        os.environ.update(spec["env"])
        import resource
        import tempfile

        tempfile.tempdir = None  # TMPDIR is the child's own
        for name, soft_hard in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, name), tuple(soft_hard))
        if spec["uid"] is not None:
            drop_privileges(spec["uid"])
        sys.argv = list(spec["argv"])
        import setproctitle  # set up by main()

        # what ps, /proc/<pid>/cmdline and the tests see: the exec path's command line, not the server's
        setproctitle.setproctitle(" ".join([sys.executable, "-I", *spec["argv"]]))
        import runpy

        runpy.run_path(spec["argv"][0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported on the child's stderr, like an exec'd child's traceback
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001, S110 - a closed or full stream: the exit status still goes out
                pass
        os._exit(code)


def serve(control: socket.socket) -> None:
    """Fork a child per spawn message until the control socket closes; report each child's pid and exit."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)
    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ, "control")
    sel.register(wake_r, selectors.EVENT_READ, "wake")
    reports: dict[int, socket.socket | None] = {}
    while True:
        for key, _ in sel.select(timeout=1.0):
            if key.data == "wake":
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
                continue
            try:
                msg, fds, flags, _addr = socket.recv_fds(control, 1 << 20, MAX_FDS)
            except InterruptedError:
                continue
            if not msg:
                return  # the parent is gone; its children are its to kill
            report = socket.socket(fileno=fds[0])
            try:
                spec = json.loads(msg)
                if flags & socket.MSG_CTRUNC or len(fds) != 4 + len(spec["fd_numbers"]):
                    raise ValueError(f"{len(fds)} fds arrived for {len(spec['fd_numbers'])} named (at most {MAX_FDS})")
                ready_r, ready_w = os.pipe()
                pid = os.fork()
            except Exception as exc:  # noqa: BLE001 - the parent raises it as OSError
                with_fds_closed(fds[1:])
                _tell(report, f"error {type(exc).__name__}: {exc}")
                report.close()
                continue
            if pid == 0:
                report.close()
                control.close()
                os.close(ready_r)
                _become_child(spec, fds[1:], ready_w)
            with_fds_closed([*fds[1:], ready_w])
            os.read(ready_r, 1)  # end of file once the child leads its own session (or died): killpg(pid) reaches it
            os.close(ready_r)
            if _tell(report, f"pid {pid}"):
                reports[pid] = report
            else:  # the parent stopped waiting (Ctrl-C, its start timeout): nobody would bound or kill this child
                os.kill(pid, signal.SIGKILL)
                report.close()
                reports[pid] = None
        while reports:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            report = reports.pop(pid, None)
            if report is not None:
                _tell(report, f"exit {os.waitstatus_to_exitcode(status)}")  # unread if the parent moved on
                report.close()


def _tell(report: socket.socket, message: str) -> bool:
    """Send one message to the parent on a child's report socket; False when the parent's end is closed."""
    try:
        report.sendall(message.encode())
        return True
    except OSError:
        return False


def with_fds_closed(fds: list[int]) -> None:
    """Close the zygote's copies of fds that now belong to a child (or to nobody)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def main() -> int:
    control = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        __import__(name)
    import setproctitle

    # set up here, while the environment is the one this process started with: a child clears it before it
    # sets its own title, and setproctitle finds the room for a title through it
    setproctitle.setproctitle(setproctitle.getproctitle())
    serve(control)
    return 0


if __name__ == "__main__":
    sys.exit(main())
