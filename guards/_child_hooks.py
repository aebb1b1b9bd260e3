"""Runtime hooks of a candidate child: installed before candidate code is imported, never removable.

Loaded by path from ``guards/_child_main.py`` (never imported by the workbench). Three parts:

- :func:`arm`: a PEP 578 audit hook (``sys.addaudithook``; Python offers no way to remove one). Once
  armed it refuses, wherever candidate code is the nearest caller outside the standard library:
  heap and frame introspection (``gc.get_objects/get_referrers/get_referents``, ``sys._getframe``,
  ``sys._current_frames``, a traceback's ``tb_frame``, a generator's or coroutine's frame), tracing
  (``sys.settrace``/``setprofile``), ``ctypes``, new processes (``os.fork``, ``os.exec*``,
  ``os.posix_spawn``, ``os.system``, ``subprocess.Popen``), sockets, and, after the import phase, code
  compiled from strings (``compile``/``exec``). For every caller it refuses file writes outside the
  child's private scratch folder and file reads outside the worktree, the scratch folder, the harness and
  the Python installation and system folders. Refusals that matter are recorded and fail the run
  (:func:`violations`); a refused ``sys._getframe`` raises :class:`HarnessDenied` (a ``ValueError``), so the
  standard library's own fallbacks (``namedtuple``, ``typing``, ``logging``) keep working.
- :func:`torch_state`: torch's process-wide settings (default device and dtype, threads, flush-denormal,
  deterministic flags, matmul precision, grad/inference mode, the torch-function and dispatch mode
  stacks), compared before and after import and after every call.
- :func:`threads`: the kernel's census of this process's threads (``/proc/self/task``), which sees
  threads started with ``_thread.start_new_thread`` that ``threading`` does not list.

Why "nearest caller outside the standard library": torch, Triton and CuTe DSL legitimately compile
(subprocess to ``ptxas``/``gcc``), use ``ctypes`` and inspect frames while candidate code calls them; the
standard library is what candidate code would use to reach the same effects directly. A candidate that
routes an action through a third-party library's internals is outside what this defends (README "Trust
model").

Source: PEP 578 (audit hooks), https://docs.python.org/3/library/audit_events.html; issue 12 item 3.
"""

from __future__ import annotations

import os
import sys

class HarnessDenied(ValueError):
    """Raised inside candidate code for an action the judge's runtime hooks refuse."""


class HarnessDeniedAccess(PermissionError):
    """Raised for a refused file access (a ``PermissionError``, as the file system itself would raise)."""


_DENY_INTROSPECTION = {"gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
                       "sys.settrace", "sys.setprofile", "sys._getframe"}
_FRAME_ATTRS = {"tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"}
_PROCESS = ("os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
            "os.startfile", "pty.spawn")
_WRITE_EVENTS = {"os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.symlink", "os.link", "os.chmod", "os.chown",
                 "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move", "os.mkfifo", "os.mknod"}
_SOFT = {"sys._getframe"}
"""Refused but not recorded as a violation: the standard library asks for frames for names only."""


def _stdlib_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    std = {os.path.realpath(paths["stdlib"]), os.path.realpath(paths["platstdlib"])}
    third = {os.path.realpath(paths["purelib"]), os.path.realpath(paths["platlib"]),
             *(os.path.realpath(p) for p in site.getsitepackages())}
    return tuple(std), tuple(third)


_STDLIB, _SITE = _stdlib_dirs()


def _under(path: str, roots) -> bool:
    return any(path == r or path.startswith(r.rstrip(os.sep) + os.sep) for r in roots)


def _is_stdlib(filename: str) -> bool:
    """The standard library (site-packages lies inside its folder but is third-party code)."""
    return filename.startswith("<frozen") or (_under(filename, _STDLIB) and not _under(filename, _SITE))


def _path_of(arg) -> str | None:
    if isinstance(arg, int) or arg is None:
        return None
    try:
        p = os.fsdecode(arg)
    except TypeError:
        return None
    return os.path.realpath(p)


def _writes(mode, flags) -> bool:
    if isinstance(mode, str):
        return any(c in mode for c in "wax+")
    if isinstance(flags, int):
        return bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
    return False


PROC_OWN_LISTABLE = ("task",)
"""The only entry of this process's ``/proc`` folder anyone may use while the hooks are armed: listing ``task``
(the harness's thread census). Everything else there (memory map, memory, environment, open fds, command line,
status, limits, ...) says which harness runs the kernel, which no serving process shows. Session 26's red team: a
kernel that read ``/proc/self/maps`` (path built from pieces, past the audit) found the perf child's shared call
slots and repeated its work 4x everywhere else, accepted; the review after it reached the same entries through
``/proc/thread-self`` and ``/proc/self/task/<tid>``. Machine-wide entries (cpuinfo, meminfo, ...) stay readable."""


def _proc_own(path: str) -> bool:
    """Whether the resolved ``path`` is this process's ``/proc/<pid>`` folder or anything under it (``self``,
    ``thread-self`` and ``task/<tid>`` resolve there)."""
    parts = path.split("/")
    return len(parts) >= 3 and parts[1] == "proc" and parts[2] in ("self", "thread-self", str(os.getpid()))


def _proc_ok(path: str) -> bool:
    """Machine-wide ``/proc`` entries (cpuinfo, meminfo, ...); never a process's own or another's."""
    if not path.startswith("/proc/") or _proc_own(path):
        return False
    return not path.split("/")[2].isdigit()


def _real_file(name) -> bool:
    return isinstance(name, str) and not name.startswith("<") and os.path.isfile(name)


class Hooks:
    """The armed hook's view for the harness (held in a local of the child's ``main``, nowhere else)."""

    def __init__(self, violations, enter_call_phase) -> None:
        self.violations = violations
        self.enter_call_phase = enter_call_phase


CANDIDATE_DIRS = ("k3_model/kernels",)
"""Folders of the worktree that hold candidate code (DESIGN.md: agents change only ``k3_model/kernels/<op>/``;
the isolation guard has proved every other file equal to the base commit's)."""


def arm(*, worktree: str, scratch: str, harness: str, extra_reads: tuple[str, ...] = (),
        candidate_dirs: tuple[str, ...] = CANDIDATE_DIRS) -> Hooks:
    """Install the audit hook. Call it once, before candidate code is imported.

    The hook's state lives in this function's closure: no module attribute reaches it, so candidate
    code cannot switch it off (and ``gc``/frame access, the other ways to reach it, are what it refuses).

    Args:
        worktree: the candidate's checkout (readable but for its ``.git``; its ``candidate_dirs`` hold
            candidate code).
        scratch: the child's private HOME/TMPDIR, the only place it may write.
        harness: the folder of the harness files (``guards/``), readable, never candidate code.
        extra_reads: more folders candidate code may read.
        candidate_dirs: folders of ``worktree`` (relative) whose code is candidate code; code compiled
            from strings counts as candidate code too.

    Returns:
        :class:`Hooks` (``violations()``: what was refused so far; ``enter_call_phase()``: imports are
        over, code compiled from strings is refused from now on).
    """
    import site
    import sysconfig

    here = os.path.realpath(__file__)
    wt, scr, har = os.path.realpath(worktree), os.path.realpath(scratch), os.path.realpath(harness)
    cand_roots = tuple(os.path.join(wt, d) for d in candidate_dirs)
    git_meta = os.path.join(wt, ".git")
    roots = {wt, scr, har, *(os.path.realpath(p) for p in extra_reads),
             os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix), os.path.realpath(sys.exec_prefix),
             *(os.path.realpath(p) for p in sysconfig.get_paths().values()),
             *(os.path.realpath(p) for p in site.getsitepackages()),
             "/usr", "/lib", "/lib64", "/etc", "/sys", "/dev", "/opt", "/var/lib", "/run/nvidia-persistenced"}
    roots.update(os.path.realpath(p) for p in sys.path if p and os.path.isdir(p))
    if os.environ.get("CUDA_HOME"):
        roots.add(os.path.realpath(os.environ["CUDA_HOME"]))
    read_roots = tuple(sorted(roots))
    found: list[str] = []
    import threading

    state = {"phase": "import"}
    local = threading.local()  # re-entry guard per thread: another thread's events never bypass the checks
    getframe = sys._getframe

    def is_candidate(filename: str) -> bool:
        if not filename:
            return False
        if filename.startswith("<") and not filename.startswith("<frozen"):
            return True
        real = os.path.realpath(filename)
        return _under(real, cand_roots) and not _under(real, (har,))

    def nearest_outside_stdlib() -> str:
        f = getframe(2)
        while f is not None:
            fn = f.f_code.co_filename
            if os.path.realpath(fn) != here and not _is_stdlib(fn):
                return fn
            f = f.f_back
        return ""

    def candidate_on_stack() -> bool:
        f = getframe(2)
        while f is not None:
            if is_candidate(f.f_code.co_filename):
                return True
            f = f.f_back
        return False

    def deny(what: str, soft: bool = False, access: bool = False):
        if not soft:
            found.append(what)
        raise (HarnessDeniedAccess if access else HarnessDenied)(f"HarnessDenied: {what} is not allowed in candidate code (the judge's runtime hooks "
                            "refuse it; see the README's Trust model)")

    def hook(event: str, args) -> None:
        if getattr(local, "busy", False):
            return
        local.busy = True
        try:
            _check(event, args)
        finally:
            local.busy = False

    def _check(event: str, args) -> None:
        if event == "open":
            path = _path_of(args[0])
            if path is None:
                return
            if _writes(args[1] if len(args) > 1 else None, args[2] if len(args) > 2 else None):
                if not _under(path, (scr, "/dev/null")):
                    deny(f"writing {path} (outside the child's private scratch folder)", access=True)
            elif _under(path, (git_meta,)):  # where the checkout came from, its branch: nothing a kernel reads
                deny(f"reading {path} (the checkout's git metadata)", access=True)
            elif _proc_own(path):
                deny(f"reading {path} (this process's /proc entries: memory map, memory, environment, open files, "
                     "command line and status tell which harness runs the kernel)", access=True)
            elif os.path.isdir(path) and is_candidate(nearest_outside_stdlib()):
                deny(f"opening the folder {path} (a folder fd opens files by relative names, past these checks)",
                     access=True)
            elif not _under(path, read_roots) and not _proc_ok(path):
                deny(f"reading {path} (outside the worktree, the scratch folder and the Python installation)",
                     access=True)
            return
        if event in ("os.listdir", "os.scandir"):
            if args and isinstance(args[0], int):
                if is_candidate(nearest_outside_stdlib()):
                    deny("listing a folder by its fd (past these checks)", access=True)
                return
            path = _path_of(args[0]) if args and isinstance(args[0], (str, bytes, os.PathLike)) else None
            if path is not None and _proc_own(path) and "/".join(path.split("/")[3:]) not in PROC_OWN_LISTABLE:
                deny(f"listing {path} (this process's /proc entries tell which harness runs the kernel)", access=True)
            return
        if event in _WRITE_EVENTS:
            for a in args[:2]:
                path = _path_of(a) if isinstance(a, (str, bytes, os.PathLike)) else None
                if path is not None and not _under(path, (scr,)):
                    deny(f"{event} on {path} (outside the child's private scratch folder)", access=True)
            return
        if event == "object.__getattr__":
            if len(args) > 1 and args[1] in _FRAME_ATTRS and is_candidate(nearest_outside_stdlib()):
                deny(f"frame access ({args[1]})")
            return
        if event in ("compile", "exec"):
            if state["phase"] != "calls":
                return
            name = args[1] if event == "compile" and len(args) > 1 else getattr(args[0], "co_filename", None)
            if not _real_file(name) and is_candidate(nearest_outside_stdlib()):
                deny(f"{event} of code built from a string after import")
            return
        if event in _DENY_INTROSPECTION:
            if event == "sys._getframe":
                if is_candidate(nearest_outside_stdlib()):
                    deny(event, soft=True)
            elif candidate_on_stack():
                deny(event)
            return
        if event.startswith(_PROCESS) or event.startswith("ctypes.") or event.startswith("socket."):
            if is_candidate(nearest_outside_stdlib()):
                deny(event)

    def enter_call_phase() -> None:
        state["phase"] = "calls"

    sys.addaudithook(hook)
    return Hooks(lambda: list(found), enter_call_phase)


def threads() -> int:
    """Threads of this process, counted by the kernel (``/proc/self/task``)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


THREAD_EXIT_GRACE_S = 0.2
"""How long a thread that was joined inside the call may take to leave ``/proc/self/task`` (seconds):
Python's ``join`` returns before the OS thread has fully exited."""


def settled_threads(expected: int) -> int:
    """The thread count once it is back to ``expected``, or after :data:`THREAD_EXIT_GRACE_S`."""
    import time

    end = time.monotonic() + THREAD_EXIT_GRACE_S
    n = threads()
    while n > expected and time.monotonic() < end:
        time.sleep(0.001)
        n = threads()
    return n


def _denormals_flushed(torch) -> bool:
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    return bool((tiny * 1.0).item() == 0.0)


def torch_state() -> dict[str, object]:
    """torch's process-wide settings that change numerics or speed (a dict of plain values)."""
    import torch

    st = {
        "default_dtype": str(torch.get_default_dtype()),
        "default_device": str(torch.get_default_device()),
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "flush_denormal": _denormals_flushed(torch),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "torch_function_modes": torch._C._len_torch_function_stack(),
        "dispatch_modes": torch._C._len_torch_dispatch_stack(),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cuda_matmul_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cuda_matmul_fp16_reduced": bool(torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction),
        "cuda_matmul_bf16_reduced": bool(torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction),
    }
    return st


def state_changes(before: dict, after: dict) -> list[str]:
    """``name: a -> b`` for each torch setting that differs."""
    return [f"{k}: {before[k]!r} -> {after.get(k)!r}" for k in before if before[k] != after.get(k)]
