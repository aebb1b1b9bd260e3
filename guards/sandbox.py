"""Run candidate code in a child process: scrubbed environment, time and memory limits.

The child (``guards/_child_main.py``) imports ``k3_model`` from the candidate's worktree; the
workbench process never does. Requests and responses travel as ``torch.save`` files read back with
``weights_only=True`` (tensors, numbers, strings, lists and dicts only).

This is defence against reward hacking, not a sandbox against a determined attacker with code
execution on the host (DESIGN.md "Trust model").
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD_MAIN = Path(__file__).with_name("_child_main.py")

_ENV_ALLOW = ("PATH", "LANG", "LC_ALL", "CUDA_VISIBLE_DEVICES", "LD_LIBRARY_PATH", "NVIDIA_VISIBLE_DEVICES",
              "CUDA_HOME", "TRITON_CACHE_DIR", "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
_TAIL_BYTES = 4000


def scrubbed_env(home: Path) -> dict[str, str]:
    """The child's environment: an allowlist of harmless variables; no keys, tokens or PYTHON* vars.

    Args:
        home: a private folder used as HOME and TMPDIR.
    """
    env = {k: os.environ[k] for k in _ENV_ALLOW if k in os.environ}
    env.update(HOME=str(home), TMPDIR=str(home), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return env


@dataclasses.dataclass(frozen=True)
class ChildOutcome:
    """What came back from one child run.

    Attributes:
        response: the decoded response, or ``None`` when the child died or wrote nothing readable.
        returncode: exit status (negative: killed by that signal).
        timed_out: the wall-clock limit was hit and the process group killed.
        duration_s: wall time (seconds).
        stdout_tail, stderr_tail: last bytes of the child's output (for evidence).
        problem: one sentence when ``response`` is ``None``.
    """

    response: dict[str, Any] | None
    returncode: int
    timed_out: bool
    duration_s: float
    stdout_tail: str
    stderr_tail: str
    problem: str | None


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - _TAIL_BYTES))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def run_child(worktree: Path, request: dict[str, Any], *, timeout_s: float, memory_bytes: int, device: str) -> ChildOutcome:
    """Run one request in a fresh child process rooted at ``worktree``.

    Args:
        worktree: the candidate's checkout (its ``k3_model`` is imported there).
        request: the request dict (see ``_child_main``).
        timeout_s: wall-clock limit (seconds); the whole process group is killed after it.
        memory_bytes: address-space cap (bytes), applied on CPU runs only (CUDA maps large ranges).
        device: ``cpu`` or ``cuda``.

    Raises:
        OSError: the child could not be started at all (an infrastructure error, not a FAIL).
    """
    import torch

    with tempfile.TemporaryDirectory(prefix="wb-child-") as tmp:
        tmpd = Path(tmp)
        home = tmpd / "home"
        home.mkdir()
        req_path, resp_path = tmpd / "request.pt", tmpd / "response.pt"
        torch.save(request, req_path)
        out_path, err_path = tmpd / "stdout.txt", tmpd / "stderr.txt"

        def limits() -> None:
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_FSIZE, (2**30, 2**30))
            if device == "cpu":
                resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

        t0 = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-I", str(CHILD_MAIN), str(worktree), str(req_path), str(resp_path)],
                cwd=str(home),
                env=scrubbed_env(home),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                preexec_fn=limits,
                start_new_session=True,
            )
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
            else:
                try:  # leftovers (background threads' processes) die with the group
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        duration = time.monotonic() - t0
        response, problem = None, None
        if timed_out:
            problem = f"child exceeded its {timeout_s:.0f} s limit and was killed"
        elif proc.returncode != 0:
            problem = f"child exited with status {proc.returncode}"
        elif not resp_path.is_file():
            problem = "child exited without writing its response"
        else:
            try:
                response = torch.load(resp_path, weights_only=True)
                if not isinstance(response, dict):
                    response, problem = None, "child response is not a dict"
            except Exception as exc:  # untrusted bytes: any decoding failure is the candidate's
                problem = f"child response unreadable ({type(exc).__name__}: {exc})"
        return ChildOutcome(response, proc.returncode, timed_out, duration, _tail(out_path), _tail(err_path), problem)
