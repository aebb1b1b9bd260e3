"""Run candidate code in a contained child process.

The child (``guards/_child_main.py``) imports ``k3_model`` from the candidate's worktree; the
workbench process never does. Containment, in the order a child meets it:

- **environment**: an allowlist of harmless variables (no keys, tokens, ``PYTHON*``); a private,
  empty HOME/TMPDIR;
- **identity** (when the workbench runs as root and ``setpriv`` exists): the child runs as a fresh
  unprivileged uid/gid chosen per run, with only ``CAP_DAC_READ_SEARCH`` (read anything, write
  nothing it does not own) and ``no_new_privs``. The worktree, the repository's ``.git`` and
  ``.workbench/results`` are root-owned, so the child cannot write them. Every process of that uid is
  killed when the run ends, so a child that escapes its process group (``setsid``) dies too;
- **limits**: wall clock (the process group, then the uid, killed), address space (CPU runs),
  processes (``RLIMIT_NPROC``: per uid, so a fork bomb stops at :data:`MAX_PROCESSES`), file size
  (``RLIMIT_FSIZE`` = :data:`OUTPUT_CAP_BYTES`: flooding stdout hits the cap, and the run is a FAIL), no
  core dumps;
- **an authenticated response channel**: the response travels through a pipe inherited by fd, framed
  with a random nonce the parent sends through a second pipe that the child reads and closes before
  any candidate code is imported. Printing a fake result does nothing (stdout is only evidence), a
  response file does not exist, and bytes written to the pipe by candidate code break the frame and
  end as FAIL, never as a forged PASS.

**How a child starts**: on CPU (``WORKBENCH_CHILD_START=fork``, the default) it is forked from this
process's fork server (``guards/_zygote.py``), which imported torch once and never imports the worktree's
code; the forked child sets up the same session, fds, folder, environment, limits, uid and capabilities as
the exec path (``tests/guards/test_zygote.py`` compares the two) and runs ``_child_main.py`` in place. GPU
children and the vLLM model eval are exec'd (``python -I _child_main.py``, under ``setpriv`` as root).

Requests travel as ``torch.save`` bytes in a memfd the child reads and closes before any candidate code
is imported; the response is read back with ``weights_only=True``
(tensors, numbers, strings, lists and dicts only).

This is defence against reward hacking, not a sandbox against a determined attacker with code
execution on the host (DESIGN.md "Trust model"): the child can still read files, use the network and
inspect its own memory (where the nonce lives).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import io
import json
import os
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from guards._protocol import NONCE_BYTES, RESPONSE_MAGIC

CHILD_MAIN = Path(__file__).with_name("_child_main.py")
ZYGOTE_MAIN = Path(__file__).with_name("_zygote.py")

_ENV_ALLOW = ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "NVIDIA_VISIBLE_DEVICES",
              "CUDA_HOME", "TRITON_CACHE_DIR", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_TAIL_BYTES = 4000

OUTPUT_CAP_BYTES = 16 * 2**20
"""Largest file the child may write, stdout and stderr included (bytes); reaching it fails the run."""
MAX_PROCESSES = 128
"""Processes and threads the child's uid may hold at once (RLIMIT_NPROC; threads count)."""
MAX_RESPONSE_BYTES = 1 << 30
"""Largest response the parent reads (bytes); a bigger one is a FAIL."""
_UID_RANGE = (200_000, 900_000)


def scrubbed_env(home: Path) -> dict[str, str]:
    """The child's environment: an allowlist of harmless variables; no keys, tokens or PYTHON* vars.

    Args:
        home: a private folder used as HOME and TMPDIR.
    """
    env = {k: os.environ[k] for k in _ENV_ALLOW if k in os.environ}
    env.update(HOME=str(home), TMPDIR=str(home), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.update(NO_MULTICAST_ENV)
    env.update(CHILD_MALLOC_ENV)
    return env


CHILD_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(256 * 2**20)}
"""glibc's allocator thresholds, fixed in every child (bytes). By default glibc moves its mmap threshold at run
time (each freed mmapped block raises it), so whether a tensor's memory comes from the heap or from its own
mapping, and whether freeing it unmaps pages inside a timed call (the perf child releases the earlier call's
tensors there), depends on the process's history: two children running the same ``torch.mm`` on the same
inputs read 0.927-1.282x (M 3, N 256, K 1536; one false regression in 8 pairs of processes) and 0.971-1.039x
(M 1, N 12448, K 256) on an idle 2-core machine; with the thresholds fixed 0.951-1.033x and 0.972-1.022x, no
false regression. With the thresholds fixed both follow one rule: blocks under 32 MiB come from the heap and stay mapped (up to 256 MiB
kept free), larger ones are mapped and unmapped on every call alike.
Source: glibc mallopt(3) (M_MMAP_THRESHOLD, M_TRIM_THRESHOLD; setting one disables the dynamic adjustment);
``bench/perf_aa_children.py``, ``bench/results/cpu/perf_aa_children_session24.json``."""


NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
"""Set in every child: NVLink multicast stays off (a program using it can take a shared host's GPUs out
of service). Source: ../.library/device/KINDS.md (multi-GPU kinds); issue 8."""


def setpriv_prefix(uid: int) -> list[str]:
    """The exec path's ``setpriv`` command line before the program: uid and gid ``uid``, no groups, only
    ``CAP_DAC_READ_SEARCH`` (inheritable, ambient, bounding set), ``no_new_privs`` (``guards/_zygote.py``
    ``drop_privileges`` leaves a forked child in the same state)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all,+dac_read_search",
            "--ambient-caps=-all,+dac_read_search", "--bounding-set=-all,+dac_read_search", "--no-new-privs", "--"]


def drop_privileges_available() -> bool:
    """Whether children run as a fresh unprivileged uid (the workbench is root and ``setpriv`` exists)."""
    return os.geteuid() == 0 and shutil.which("setpriv") is not None


@dataclasses.dataclass(frozen=True)
class ChildOutcome:
    """What came back from one child run.

    Attributes:
        response: the decoded response, or ``None`` when the child died or wrote nothing valid.
        returncode: exit status (negative: killed by that signal).
        timed_out: the wall-clock limit was hit and the child's processes killed.
        duration_s: wall time (seconds).
        stdout_tail, stderr_tail: last bytes of the child's output (for evidence).
        problem: one sentence when ``response`` is ``None`` (crashed, timed out, out of memory, output
            cap, forged or broken response).
        uid: the uid the child ran as (``None``: the workbench's own).
    """

    response: dict[str, Any] | None
    returncode: int
    timed_out: bool
    duration_s: float
    stdout_tail: str
    stderr_tail: str
    problem: str | None
    uid: int | None = None


def tail_lines(text: str, limit: int) -> str:
    """The end of ``text`` in at most ``limit`` characters, starting at a line: a cut inside the first kept
    line drops that line's head and says so (``...``), so no summary starts mid-word. A last line longer
    than ``limit`` is cut at a space where it can be.

    Args:
        text: a child's output (stderr or stdout), any length.
        limit: the most characters returned (count, >= 8).

    Raises:
        ValueError: ``limit`` below 8.
    """
    if limit < 8:
        raise ValueError(f"tail_lines: limit must be >= 8 characters; got {limit}")
    if len(text) <= limit:
        return text
    cut = text[-(limit - 4):]
    nl = cut.find("\n")
    if 0 <= nl < len(cut) - 1:
        return "...\n" + cut[nl + 1:]
    sp = cut.find(" ")
    return "... " + (cut[sp + 1:] if 0 <= sp < len(cut) - 1 else cut)


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def _death_problem(returncode: int, out_bytes: int, err_bytes: int) -> str:
    """One sentence for a child that exited without a valid response."""
    if returncode == -signal.SIGXFSZ or max(out_bytes, err_bytes) >= OUTPUT_CAP_BYTES:
        return (f"child exceeded the {OUTPUT_CAP_BYTES // 2**20} MiB output/file-size cap "
                f"(stdout {out_bytes} bytes, stderr {err_bytes} bytes) and was killed")
    if returncode == -signal.SIGKILL:
        return "child was killed (SIGKILL: out of memory or killed from outside)"
    if returncode < 0:
        return f"child crashed ({_signal_name(returncode)})"
    if returncode != 0:
        return f"child exited with status {returncode} before answering (os._exit, sys.exit or a fatal error)"
    return "child exited without writing its response"


def _user_tasks(uid: int) -> int:
    """Threads and processes of ``uid`` now (what RLIMIT_NPROC counts)."""
    n = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                n += int(fields.get("Threads", "1"))
        except (OSError, KeyError, ValueError):
            continue
    return n


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (``kill -9 -1`` run as that uid; it never reaches others)."""
    kill = shutil.which("kill") or "/bin/kill"
    for _ in range(3):  # a fork loop may spawn while the first sweep runs
        subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", kill, "-9", "-1"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)


PIPE_BYTES = 1 << 20
"""Capacity asked of the response pipe (bytes; Linux ``F_SETPIPE_SZ``, capped by ``/proc/sys/fs/pipe-max-size``,
1 MiB by default). The default 64 KiB pipe hands a correctness response over in 64 KiB turns between the child
and the reader: a 900 MiB response (the size of KDA's correctness response, 948 MB) took 1.44 s to write that way,
0.22 s with this pipe and the payload written without a copy into a frame (``guards/_child_main.py`` ``_send``);
start to last byte 4.92 s -> 3.68 s (medians of 5, ``bench/results/cpu/response_channel_session26.json``)."""


def _widen_pipe(fd: int) -> None:
    """Ask for a :data:`PIPE_BYTES` pipe behind ``fd``; a kernel that refuses keeps the default (only slower)."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
    except OSError:
        pass


def _read_frame(raw: bytes, nonce: bytes) -> tuple[bytes | None, str | None]:
    """Payload of one response frame, or ``(None, why)`` when it is missing, forged or malformed."""
    head = len(RESPONSE_MAGIC) + NONCE_BYTES + 8
    if not raw:
        return None, None
    if len(raw) < head or not raw.startswith(RESPONSE_MAGIC):
        return None, "response channel carried bytes that are not a response frame (forged or corrupted)"
    if not secrets.compare_digest(raw[len(RESPONSE_MAGIC):len(RESPONSE_MAGIC) + NONCE_BYTES], nonce):
        return None, "response frame carries the wrong nonce (forged response)"
    (n,) = struct.unpack("<Q", raw[head - 8:head])
    if len(raw) != head + n:
        return None, (f"response channel carried {len(raw) - head} payload bytes, frame says {n} "
                      "(extra writes to the channel: forged or corrupted)")
    return raw[head:], None


def run_child(worktree: Path, request: dict[str, Any], *, timeout_s: float, memory_bytes: int, device: str,
              max_response_bytes: int | None = None, pass_fds: tuple[int, ...] = ()) -> ChildOutcome:
    """Run one request in a fresh, contained child process rooted at ``worktree``.

    Args:
        worktree: the candidate's checkout (its ``k3_model`` is imported there).
        request: the request dict (see ``_child_main``).
        timeout_s: wall-clock limit (seconds); every process of the child is killed after it.
        memory_bytes: address-space cap (bytes), applied on CPU runs only (CUDA maps large ranges).
        device: ``cpu`` or ``cuda``.
        max_response_bytes: the response this request may need (bytes: the outputs of every call it asks
            for); the cap is the larger of it and :data:`MAX_RESPONSE_BYTES`.
        pass_fds: extra fds the child inherits (their numbers travel in ``request``; the caller closes them).

    Returns:
        The outcome; a crash, hang, flood or forged response is data here (``problem``), never raised.

    Raises:
        OSError: the child could not be started at all (an infrastructure error, not a FAIL).
    """
    with child_session(worktree, request, timeout_s=timeout_s, memory_bytes=memory_bytes, device=device,
                       max_response_bytes=max_response_bytes, pass_fds=pass_fds) as s:
        pass
    return s.outcome


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)

class ChildTimeout(Exception):
    """The child did not answer before its wall-clock limit (the session kills it on exit)."""


class ChildGone(Exception):
    """The child stopped talking (closed its pipe, or sent bytes that are not an acknowledgement)."""


class ChildSession:
    """A running contained child (see :func:`child_session`).

    Attributes:
        proc: the child's ``Popen``.
        deadline: ``time.monotonic()`` value after which the child is killed.
        nonce: the bytes that authenticate the child's frames and acknowledgements.
        outcome: the :class:`ChildOutcome`, set when the session ends.
    """

    def __init__(self, proc, deadline: float, nonce: bytes) -> None:
        self.proc, self.deadline, self.nonce = proc, deadline, nonce
        self.outcome: ChildOutcome | None = None
        self.timed_out = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_ns(self) -> int:
        """CPU time (nanoseconds) of every thread of the child process, dead threads included.

        Read by the judge from the kernel (the process CPU-time clock, ``clock_getcpuclockid``): the
        child cannot change it, and it includes the time of threads ``threading`` does not list.
        When the child runs under ``setpriv``, this is the clock of the python process itself.

        Raises:
            ChildGone: the child is gone.
        """
        try:
            return time.clock_gettime_ns(((~self._python_pid()) << 3) | 2)
        except OSError as exc:
            raise ChildGone(f"child process is gone ({exc})") from exc

    def wait_blocked(self, limit_s: float = 0.05) -> None:
        """Return once the child's main thread sleeps (blocked on its command pipe), or after ``limit_s``.

        The kernel brings a running task's CPU time up to date only when it is switched out (or at a
        scheduler tick), so the judge reads the clock after the child has gone back to sleep.
        """
        path = f"/proc/{self.proc.pid}/task/{self.proc.pid}/stat"
        end = time.monotonic() + limit_s
        while time.monotonic() < end:
            try:
                with open(path, "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                return
            if state in (b"S", b"D", b"t", b"T", b"Z", b"X"):
                return

    def _python_pid(self) -> int:
        # setpriv execs python in place: same pid
        return self.proc.pid


_live_lock = threading.Lock()
_live: dict[int, int | None] = {}
"""Process-group id -> uid (None: the workbench's own) of every child started and not yet reaped."""
_stopped_on_interrupt = 0
"""Children killed by their session's clean-up because an exception (Ctrl-C) left it, not yet reported."""


def kill_all_children() -> int:
    """Kill every live child's process group (and its uid's processes): the Ctrl-C path.

    Safe from any thread; the sessions' own clean-up then finds them dead. Returns how many process
    groups were stopped: those signalled here, plus those their session killed on its way out since
    the last call (a Ctrl-C unwinds through the session first, so those are most of them).
    """
    global _stopped_on_interrupt
    with _live_lock:
        live = dict(_live)
        earlier, _stopped_on_interrupt = _stopped_on_interrupt, 0
    for pgid, uid in live.items():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        if uid is not None:
            _kill_uid(uid)
    return len(live) + earlier


@contextlib.contextmanager
def child_session(worktree: Path, request: dict[str, Any], *, timeout_s: float, memory_bytes: int, device: str,
                  pass_fds: tuple[int, ...] = (), setup: Any = None,
                  max_response_bytes: int | None = None) -> Iterator[ChildSession]:
    """Start a contained child and yield it while the caller talks to it; collect its outcome at the end.

    Same containment as :func:`run_child`. Inside the ``with`` block the caller may exchange messages
    with the child over fds it passed in ``pass_fds`` (closed here in the parent once the child has
    them, unless ``setup`` keeps its own copies); at the end the child gets the rest of its time to
    exit, then every process of it is killed and ``session.outcome`` is set.

    Args:
        pass_fds: extra fds the child inherits (their numbers travel in ``request``).
        setup: optional ``callable(home: Path, uid: int | None)`` run before the child starts (e.g. to
            give the child's uid a file).

    Raises:
        OSError: the child could not be started.
    """
    import torch

    drop = drop_privileges_available()
    uid = secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) + _UID_RANGE[0] if drop else None
    with tempfile.TemporaryDirectory(prefix="wb-child-") as tmp, contextlib.ExitStack() as request_held:
        tmpd = Path(tmp)
        home = tmpd / "home"
        home.mkdir()
        # the request travels in memory (a memfd the child reads, then closes), never through a file on disk:
        # the correctness request holds every case's inputs (2 GB for small_m_gemm's K3 shapes), and writing
        # it to a disk-backed /tmp cost 6.3 s, to a memfd 1.2 s (bench/results/cpu/request_channel_session25.json)
        req_fd = os.memfd_create("request")  # close-on-exec: only the child gets it (pass_fds)
        request_held.callback(_close_quietly, req_fd)  # also when anything fails before the child has it
        with open(req_fd, "wb", closefd=False) as f:
            torch.save(request, f)
        out_path, err_path = tmpd / "stdout.txt", tmpd / "stderr.txt"
        env = scrubbed_env(home)
        if uid is not None:
            os.chown(home, uid, uid)
            os.chmod(tmpd, 0o711)  # the child reaches its home, cannot list or write the parent's files
            env["TRITON_CACHE_DIR"] = str(home / ".triton")  # a root-owned cache is not writable there
        if setup is not None:
            setup(home, uid)
        nonce = secrets.token_bytes(NONCE_BYTES)
        resp_r, resp_w = os.pipe()
        _widen_pipe(resp_w)
        nonce_r, nonce_w = os.pipe()
        # a fresh uid starts from zero; a shared uid's count includes the user's other processes
        nproc = MAX_PROCESSES if uid is not None else _user_tasks(os.getuid()) + MAX_PROCESSES

        rlimits = {"RLIMIT_CORE": (0, 0), "RLIMIT_FSIZE": (OUTPUT_CAP_BYTES, OUTPUT_CAP_BYTES)}
        if uid is not None or os.geteuid() != 0:  # root ignores RLIMIT_NPROC; setpriv drops root first
            rlimits["RLIMIT_NPROC"] = (nproc, nproc)
        if device == "cpu":
            rlimits["RLIMIT_AS"] = (memory_bytes, memory_bytes)

        def limits() -> None:
            import resource

            for name, soft_hard in rlimits.items():
                resource.setrlimit(getattr(resource, name), soft_hard)

        child_args = [str(CHILD_MAIN), str(worktree), str(req_fd), str(resp_w), str(nonce_r)]
        argv = [sys.executable, "-I", *child_args]
        zygote = _zygote_for(env) if forked_start(device, request) else None
        if uid is not None:
            argv = [*setpriv_prefix(uid), *argv]
        chunks: list[bytes] = []
        overflow = threading.Event()

        cap = max(MAX_RESPONSE_BYTES, max_response_bytes or 0)

        def drain() -> None:
            # Past the cap the bytes are read and dropped: a reader that stopped would leave the child
            # blocked in its write until the wall-clock limit, and the verdict would blame a hang.
            total = 0
            while True:
                try:
                    b = os.read(resp_r, 1 << 20)
                except OSError:
                    return
                if not b:
                    return
                total += len(b)
                if total > cap:
                    if not overflow.is_set():
                        overflow.set()
                        chunks.clear()
                    continue
                chunks.append(b)

        t0 = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            try:
                if zygote is not None:
                    proc = zygote.spawn(child_args, cwd=home, env=env, stdout=out.fileno(), stderr=err.fileno(),
                                        fds=(resp_w, nonce_r, req_fd, *pass_fds), rlimits=rlimits, uid=uid)
                else:
                    proc = subprocess.Popen(
                        argv, cwd=str(home), env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                        preexec_fn=limits, start_new_session=True, pass_fds=(resp_w, nonce_r, req_fd, *pass_fds),
                    )
            finally:
                request_held.close()  # the child holds its own fd to the request now
                os.close(resp_w)
                os.close(nonce_r)
            reader = threading.Thread(target=drain, name="wb-child-response", daemon=True)
            reader.start()
            try:
                os.write(nonce_w, nonce)
            except OSError:
                pass  # the child died before reading it; its exit status says why
            finally:
                os.close(nonce_w)
            session = ChildSession(proc, t0 + timeout_s, nonce)
            with _live_lock:
                _live[proc.pid] = uid
            interrupted = False
            try:
                yield session
            except ChildTimeout:
                session.timed_out = True
            except ChildGone:
                pass  # its exit status and response say why
            except BaseException:  # Ctrl-C or an error of the caller: kill now, do not wait for the child
                interrupted = True
                raise
            finally:
                timed_out = session.timed_out
                try:
                    if not timed_out and not interrupted:
                        try:
                            proc.wait(timeout=max(0.0, session.deadline - time.monotonic()))
                        except subprocess.TimeoutExpired:
                            timed_out = True
                        except BaseException:
                            interrupted = True
                            raise
                finally:  # also when Ctrl-C lands in the wait: the child never outlives the session
                    if interrupted:  # counted for the Ctrl-C message (kill_all_children)
                        global _stopped_on_interrupt
                        with _live_lock:
                            _stopped_on_interrupt += 1
                    try:  # leftovers (background processes) die with the group
                        os.killpg(proc.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    if uid is not None:
                        _kill_uid(uid)  # and with the uid, wherever they moved (setsid, double fork)
                    proc.wait()
                    with _live_lock:
                        _live.pop(proc.pid, None)
                    reader.join(timeout=10)
                    os.close(resp_r)
        duration = time.monotonic() - t0
        out_bytes, err_bytes = out_path.stat().st_size, err_path.stat().st_size
        response, problem = None, None
        raw = b"".join(chunks)
        chunks.clear()  # the response is held once, then twice while it is framed and loaded, not three times
        payload, frame_problem = _read_frame(raw, nonce)
        del raw
        if overflow.is_set():  # first: a child over the cap may also have run out of time writing it
            problem = (f"child response exceeded {cap} bytes (the outputs of every call are sent back: shrink the "
                       f"workloads' outputs, or raise guards.sandbox.MAX_RESPONSE_BYTES)")
        elif timed_out:
            problem = f"child exceeded its {timeout_s:.0f} s limit (wall clock) and was killed"
        elif max(out_bytes, err_bytes) >= OUTPUT_CAP_BYTES:  # Python ignores SIGXFSZ: writes fail with EFBIG
            problem = _death_problem(-signal.SIGXFSZ, out_bytes, err_bytes)
        elif frame_problem:
            problem = frame_problem
        elif proc.returncode != 0 or payload is None:
            problem = _death_problem(proc.returncode, out_bytes, err_bytes)
        else:
            try:
                response = torch.load(io.BytesIO(payload), weights_only=True)
                if not isinstance(response, dict):
                    response, problem = None, "child response is not a dict"
            except Exception as exc:  # untrusted bytes: any decoding failure is the candidate's
                problem = f"child response unreadable ({type(exc).__name__}: {exc})"
        session.outcome = ChildOutcome(response, proc.returncode, timed_out, duration, _tail(out_path),
                                       _tail(err_path), problem, uid)
        from guards import progress

        progress.check_interrupt()  # a Ctrl-C whose KeyboardInterrupt was lost while the child ran


# ---- the fork server (guards/_zygote.py) ----------------------------------------------------------------------

ZYGOTE_START_S = 300.0
"""Longest wait for the fork server's answer to a spawn (seconds): its first spawn waits for its imports."""
_PER_CHILD_ENV = ("HOME", "TMPDIR", "TRITON_CACHE_DIR")
"""Variables that differ between children; the rest of a child's environment is its fork server's."""


def forked_start(device: str, request: dict[str, Any]) -> bool:
    """Whether this child is forked from a fork server (:class:`Zygote`) rather than exec'd.

    CPU children other than the vLLM model eval (whose engine starts processes of its own), unless
    ``WORKBENCH_CHILD_START=exec``. CUDA children are always exec'd: a fork server that imported torch
    has not been judged on a GPU (a CUDA context must never exist in a process that forks).
    """
    from workbench import envs

    return device == "cpu" and request.get("mode") != "model_eval_vllm" and envs.CHILD_START.read() == "fork"


class _ForkedProc:
    """The ``subprocess.Popen`` face of a child forked by a :class:`Zygote`: its pid, its exit status as
    the fork server reports it once it has reaped the child."""

    def __init__(self, pid: int, report: socket.socket) -> None:
        self.pid, self.returncode, self._report = pid, None, report

    def wait(self, timeout: float | None = None) -> int:
        """The child's return code (negative: the signal that ended it), waiting up to ``timeout`` seconds.

        Raises:
            subprocess.TimeoutExpired: the child still runs after ``timeout``.
        """
        if self.returncode is not None:
            return self.returncode
        # a zero timeout would make the socket non-blocking (BlockingIOError, not a timeout): a poll waits 1 ms
        self._report.settimeout(None if timeout is None else max(timeout, 1e-3))
        try:
            msg = self._report.recv(256)
        except TimeoutError:
            raise subprocess.TimeoutExpired(f"guard child {self.pid}", timeout) from None
        if msg.startswith(b"exit "):
            self.returncode = int(msg[5:])
        else:  # the fork server is gone: the child's status is lost, so it is killed and counted as killed
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            self.returncode = -signal.SIGKILL
        self._report.close()
        return self.returncode


class Zygote:
    """A fork server (``guards/_zygote.py``) of this process: CPU guard children start from it with torch
    imported. One per environment (:func:`_zygote_for`); it exits when this process closes its socket.

    Raises:
        OSError: the fork server could not be started.
    """

    def __init__(self, env: dict[str, str]) -> None:
        self.home = tempfile.mkdtemp(prefix="wb-zygote-")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._lock = threading.Lock()
        self.log = Path(self.home) / "zygote.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", str(ZYGOTE_MAIN), str(theirs.fileno())], cwd=self.home,
                env={**env, "HOME": self.home, "TMPDIR": self.home}, stdin=subprocess.DEVNULL,
                stdout=log, stderr=log, pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.sock = mine

    def spawn(self, argv: list[str], *, cwd: Path, env: dict[str, str], stdout: int, stderr: int,
              fds: tuple[int, ...], rlimits: dict[str, tuple[int, int]], uid: int | None) -> _ForkedProc:
        """Fork one contained child running ``python -I <argv...>`` (``guards/_zygote.py`` ``_become_child``).

        Args:
            argv: the script and its arguments.
            cwd, env: the child's working folder and whole environment.
            stdout, stderr: fds the child writes its output to.
            fds: fds the child holds at the same numbers (every other fd is closed there).
            rlimits: ``resource`` limit name -> (soft, hard).
            uid: the fresh uid to run as (``None``: this process's own).

        Raises:
            OSError: the fork server refused or is gone.
        """
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # the signals this process ignores now: an exec'd child inherits them ignored (helper-35: not the server's
        # own at its start, which a long-lived judge may since have changed)
        ignored = [int(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD) if signal.getsignal(s) == signal.SIG_IGN]
        spec = {"argv": argv, "cwd": str(cwd), "env": env, "rlimits": rlimits, "uid": uid, "fd_numbers": list(fds),
                "ignored_signals": ignored}
        try:
            with open(os.devnull, "rb") as stdin, self._lock:
                socket.send_fds(self.sock, [json.dumps(spec).encode()], [theirs.fileno(), stdin.fileno(), stdout,
                                                                          stderr, *fds])
        except OSError as exc:
            mine.close()
            raise OSError(f"the guard children's fork server is gone ({exc}); its log: {_tail(self.log)}") from exc
        finally:
            theirs.close()
        mine.settimeout(ZYGOTE_START_S)
        try:
            msg = mine.recv(256)
        except TimeoutError:
            msg = b"no answer within %d s" % ZYGOTE_START_S
        except BaseException:  # Ctrl-C: the closed socket tells the server to kill the child it forks
            mine.close()
            raise
        if not msg.startswith(b"pid "):
            mine.close()
            raise OSError(f"the guard children's fork server could not start a child: "
                          f"{msg.decode(errors='replace') or 'it exited'}; its log: {_tail(self.log)}")
        return _ForkedProc(int(msg[4:]), mine)

    def close(self) -> None:
        """End the fork server (its children are not touched) and remove its folder."""
        self.sock.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.home, ignore_errors=True)


_zygotes: dict[tuple, Zygote] = {}
_zygotes_lock = threading.Lock()


def _zygote_for(env: dict[str, str]) -> Zygote:
    """This process's fork server for children of environment ``env`` (started on first use; one whose
    environment differs in anything but :data:`_PER_CHILD_ENV` is another; one that exited is replaced)."""
    base = {k: v for k, v in env.items() if k not in _PER_CHILD_ENV}
    key = (sys.executable, *sorted(base.items()))
    with _zygotes_lock:
        z = _zygotes.get(key)
        if z is not None and z.proc.poll() is not None:
            z.close()
            z = None
        if z is None:
            z = _zygotes[key] = Zygote(base)
        return z


def warm_zygote(device: str) -> None:
    """Start this process's fork server for ``device`` now, if its children fork from one (:func:`forked_start`):
    its imports then overlap what runs before the first child (the worktree, isolation, the audit)."""
    if forked_start(device, {"mode": "correctness"}):
        _zygote_for(scrubbed_env(Path(tempfile.gettempdir())))


def close_zygotes() -> None:
    """End every fork server of this process (at exit; tests)."""
    with _zygotes_lock:
        zs = list(_zygotes.values())
        _zygotes.clear()
    for z in zs:
        z.close()


def _forget_zygotes_in_child() -> None:
    # a process forked from this one (a pool worker) starts fork servers of its own: sharing one would tie its
    # children's lifetime to ours
    global _zygotes_lock
    _zygotes_lock = threading.Lock()  # another thread may have held it at the fork
    for z in _zygotes.values():
        with contextlib.suppress(OSError):
            z.sock.close()
    _zygotes.clear()


os.register_at_fork(after_in_child=_forget_zygotes_in_child)
atexit.register(close_zygotes)


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous of one multi-rank run)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(worktree: Path, requests: list[dict[str, Any]], *, backend: str, collective_timeout_s: float,
              timeout_s: float, memory_bytes: int, device: str) -> list[ChildOutcome]:
    """Run one contained child per TP rank at once, joined into one ``torch.distributed`` group.

    Each rank is a :func:`run_child` of its own (own uid, limits and authenticated response channel),
    so the parent reads every rank's outputs directly and a rank cannot speak for another. The ranks
    meet at a TCP rendezvous on 127.0.0.1; rank ``r`` of a CUDA run uses GPU ``r``.

    Args:
        worktree: the candidate's checkout.
        requests: one request per rank (index = rank); each gets a ``dist`` entry added here.
        backend: ``gloo`` or ``nccl``.
        collective_timeout_s: a collective waiting longer fails (seconds), so a dead peer ends as an
            error, not a hang.
        timeout_s, memory_bytes, device: as for :func:`run_child`, per rank.

    Returns:
        The outcomes, index = rank.

    Raises:
        OSError: a child could not be started at all.
    """
    from concurrent.futures import ThreadPoolExecutor

    world = len(requests)
    init = f"tcp://127.0.0.1:{free_tcp_port()}"
    reqs = [{**r, "dist": {"rank": i, "world_size": world, "init_method": init, "backend": backend,
                           "timeout_s": float(collective_timeout_s)}} for i, r in enumerate(requests)]
    with ThreadPoolExecutor(max_workers=world) as pool:
        futs = [pool.submit(run_child, worktree, r, timeout_s=timeout_s, memory_bytes=memory_bytes, device=device)
                for r in reqs]
        return [f.result() for f in futs]
