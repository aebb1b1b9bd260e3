"""Shared fixtures: a throwaway git copy of the project, so runs never touch the real .workbench/."""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import machine_state

REPO_ROOT = Path(__file__).resolve().parents[1]
_IGNORE = shutil.ignore_patterns(".git", ".workbench", "__pycache__", ".pytest_cache", "*.egg-info", ".device",
                                 ".gpuwork", ".hypothesis", "build", ".whl", ".gl")
GIT_ENV = {"GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@localhost",
           "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@localhost"}


def git(cwd: Path, *args: str) -> str:
    """Run git in ``cwd`` with a fixed identity; return stdout."""
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          env={**os.environ, **GIT_ENV}).stdout.strip()


def set_aside_merged_kernels(root: Path) -> list[str]:
    """Delete every merged kernel file under ``root/k3_model/kernels/<op>/`` (each folder keeps its
    README.md), as the repository was before any kernel was merged; returns the deleted paths. For tests
    about mechanics (the review queue, the agent loop) that judge a good fixture as a new candidate: on a
    base where it is merged already it would be judged on a fixture base and never queued."""
    gone = []
    for f in sorted((root / "k3_model" / "kernels").glob("*/**/*")):
        if f.is_file() and f.name != "README.md":
            f.unlink()
            gone.append(str(f.relative_to(root)))
    for d in sorted((root / "k3_model" / "kernels").glob("*/**/"), reverse=True):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    return gone


def make_project_copy(dest: Path, *, pristine: bool = False) -> Path:
    """Copy the current working tree (committed or not) into ``dest`` as a fresh one-commit repo
    (``pristine``: with the merged kernels set aside, :func:`set_aside_merged_kernels`)."""
    shutil.copytree(REPO_ROOT, dest, ignore=_IGNORE, symlinks=True)
    if pristine:
        set_aside_merged_kernels(dest)
    git(dest, "init", "-q", "-b", "main")
    git(dest, "add", "-A")
    git(dest, "commit", "-qm", "base")
    return dest


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_in_the_test_process() -> Iterator[None]:
    """The test process (the judge of in-process judgments, and the model tests) runs torch on one thread, as
    the guards' children do (``OMP_NUM_THREADS=1``, ``guards.sandbox.scrubbed_env``). With torch's default (one
    thread a core) two pytest-xdist workers each ran a pool of two threads on the 2 cores besides their
    children: 17 correctness fixtures of small_m_gemm and lse_merge took 304 s (433 s user CPU) against 191 s
    (251 s) on one thread (``bench/results/cpu/ci_session25.md``). Subprocesses (the CLI, a vLLM server) keep
    their own defaults."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def project_repo(tmp_path_factory) -> Path:
    """A session-wide git copy of the project (runs write their .workbench/ there)."""
    return make_project_copy(tmp_path_factory.mktemp("project") / "repo")


@pytest.fixture(scope="session")
def pristine_repo(tmp_path_factory) -> Path:
    """A session-wide git copy of the project without its merged kernels (:func:`set_aside_merged_kernels`)."""
    return make_project_copy(tmp_path_factory.mktemp("pristine") / "repo", pristine=True)


@pytest.fixture
def fresh_repo(tmp_path) -> Path:
    """A git copy of the project for tests that change branches or history."""
    return make_project_copy(tmp_path / "repo")


# ---- a quiet machine while a speedup is judged ---------------------------------------------------
#
# Under pytest-xdist the workers share the machine's cores, and a timing taken beside another
# worker's judgment is skewed by it: an honest candidate's real 1.1x gain can measure as 1.03x. So
# every test holds a shared lock while it runs, and in a test marked ``quiet`` (it asserts a CPU perf
# gain) the perf guard's timing section (``guards.perf.timing_section``) takes it exclusively, with a
# turnstile so it is not starved: while that candidate is timed nothing else of the session runs.
# Everything else, rejections by perf included, runs in parallel. ``quiet(whole=True)`` holds the
# machine for the whole test (one that times through a ``workbench`` subprocess, out of the hook's reach).

LOCK_WAIT_S = 1200.0
"""Longest wait for a machine lock (seconds): past it the test fails instead of hanging CI."""

# This worker's lock state lives in tests/machine_state.py: pytest loads this file as the module
# ``conftest``, while test modules import its helpers (``expecting_gain``, ``released_share``) from
# ``tests.conftest``, a second module object with globals of its own.
_held = machine_state.held
_waits = machine_state.waits
LOCK_LOG = "lock-times.jsonl"
"""In the shared lock folder: one line per test with its lock times (summed in the terminal summary)."""


def shared_session_dir(factory: pytest.TempPathFactory, name: str) -> Path:
    """The folder ``name`` that every pytest-xdist worker of this session shares (beside the workers' own
    base temp dirs; without xdist, in the session's base temp dir), created if missing."""
    base = factory.getbasetemp()
    d = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def _shared_dir(factory: pytest.TempPathFactory) -> Path:
    return shared_session_dir(factory, "machine-locks")


def _flock(f, mode: int) -> None:
    """``flock(f, mode)``, failing after :data:`LOCK_WAIT_S` instead of waiting for ever."""
    import time

    end = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(f, mode | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > end:
                raise RuntimeError(f"machine lock {f.name}: not granted within {LOCK_WAIT_S:.0f} s "
                                   "(a test holding it hangs, or two workers wait on each other)") from None
            time.sleep(0.05)


def _through_turnstile(d: Path, machine, mode: int) -> None:
    t0 = time.monotonic()
    with open(d / "turnstile", "a+") as turnstile:
        _flock(turnstile, fcntl.LOCK_EX)
        try:
            _flock(machine, mode)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
    _waits["shared_wait_s"] = _waits.get("shared_wait_s", 0.0) + time.monotonic() - t0


@contextlib.contextmanager
def _exclusive(d: Path) -> Iterator[None]:
    """The machine to this worker alone; its own shared hold (if a test runs) is given up meanwhile.
    Nested (a ``quiet`` test that times in-process): the outer hold covers it."""
    if _held.get("exclusive"):
        yield
        return
    held = _held.get("machine")
    if held is not None:
        fcntl.flock(held, fcntl.LOCK_UN)
    try:
        with open(d / "turnstile", "a+") as turnstile, open(d / "machine", "a+") as machine:
            t0 = time.monotonic()
            _flock(turnstile, fcntl.LOCK_EX)  # shut: tests that start now wait until this ends
            try:
                _flock(machine, fcntl.LOCK_EX)
                _held["exclusive"] = True
                t1 = time.monotonic()
                try:
                    yield
                finally:
                    _held.pop("exclusive", None)
                    fcntl.flock(machine, fcntl.LOCK_UN)
                    _waits["exclusive_wait_s"] = _waits.get("exclusive_wait_s", 0.0) + t1 - t0
                    _waits["exclusive_held_s"] = _waits.get("exclusive_held_s", 0.0) + time.monotonic() - t1
            finally:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
    finally:
        if held is not None:
            _through_turnstile(d, held, fcntl.LOCK_SH)


@contextlib.contextmanager
def released_share() -> Iterator[None]:
    """Give up this worker's shared hold while it waits on another worker (e.g. for the corpus case
    that worker is judging, whose timing needs the machine): otherwise the two would wait on each other."""
    held, d = _held.get("machine"), _held.get("dir")
    if held is None:
        yield
        return
    fcntl.flock(held, fcntl.LOCK_UN)
    try:
        yield
    finally:
        _through_turnstile(d, held, fcntl.LOCK_SH)


def once_per_session(path: Path, make: Callable[[], dict]) -> dict:
    """``make()``'s result (a JSON-able dict), computed by the first worker to ask and read back from ``path``
    by every later asker, under a file lock. A waiting worker gives up its machine share meanwhile (the one
    computing may need the machine alone to time). An exception of ``make`` is stored as
    ``{"error": "<type>: <text>"}`` and returned to every asker, so none computes it again."""
    import filelock

    lock = filelock.FileLock(str(path) + ".lock")
    with released_share():
        lock.acquire()
    try:
        if not path.exists():
            try:
                data = make()
            except Exception as exc:  # reported by every test that asks
                data = {"error": f"{type(exc).__name__}: {exc}"}
            path.write_text(json.dumps(data))
        return json.loads(path.read_text())
    finally:
        lock.release()


@contextlib.contextmanager
def expecting_gain() -> Iterator[None]:
    """Inside the block, the perf guard times with the machine to itself (for a session fixture that
    needs an accept resting on a CPU gain; tests use the ``quiet`` marker)."""
    _held["gain"] = True
    try:
        yield
    finally:
        _held.pop("gain", None)


@pytest.fixture(scope="session", autouse=True)
def _timing_takes_the_machine(tmp_path_factory) -> Iterator[None]:
    """Under pytest-xdist, the perf guard's timing section holds the machine exclusively where a gain
    is expected (see above)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    import guards.perf

    d = _shared_dir(tmp_path_factory)
    old = guards.perf.timing_section
    guards.perf.timing_section = lambda: _exclusive(d) if _held.get("gain") else contextlib.nullcontext()
    try:
        yield
    finally:
        guards.perf.timing_section = old


@pytest.fixture(scope="session", autouse=True)
def _children_counted() -> Iterator[None]:
    """Every guard child a test starts in this process (``guards.sandbox.child_session``) is counted, with its
    wall time, into the test's machine-lock line (summed in the terminal summary): each child pays a fixed
    start (a fresh interpreter importing torch, ~1.8 s on the 2-core machine) before any work, so the count
    says what that start costs the suite. Children of ``workbench`` subprocesses are not counted."""
    import guards.judge
    import guards.sandbox

    real = guards.sandbox.child_session

    @contextlib.contextmanager
    def counted(*args, **kwargs):
        t0 = time.monotonic()
        try:
            with real(*args, **kwargs) as session:
                yield session
        finally:
            _waits["children"] = _waits.get("children", 0) + 1
            _waits["child_s"] = _waits.get("child_s", 0.0) + time.monotonic() - t0

    guards.sandbox.child_session = guards.judge.child_session = counted
    try:
        yield
    finally:
        guards.sandbox.child_session = guards.judge.child_session = real


@pytest.fixture(autouse=True)
def _machine_share(request, tmp_path_factory) -> Iterator[None]:
    """Each test holds the machine shared (``quiet`` ones: exclusively) while it runs (pytest-xdist only)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    d = _shared_dir(tmp_path_factory)
    quiet = request.node.get_closest_marker("quiet")
    try:
        if quiet is not None and quiet.kwargs.get("whole"):
            with _exclusive(d):
                yield
            return
        with open(d / "machine", "a+") as machine:
            _through_turnstile(d, machine, fcntl.LOCK_SH)
            _held.update(machine=machine, dir=d)
            if quiet is not None:
                _held["gain"] = True
            try:
                yield
            finally:
                for k in ("machine", "dir", "gain"):
                    _held.pop(k, None)
                fcntl.flock(machine, fcntl.LOCK_UN)
    finally:
        line = {"test": request.node.nodeid, "quiet": quiet is not None, **{k: round(v, 2) for k, v in _waits.items()}}
        _waits.clear()
        with open(d / LOCK_LOG, "a") as log:  # one short write per line: lines of two workers do not mix
            log.write(json.dumps(line) + "\n")


WORKER_MEMORY_BYTES = 7 * 2**30
"""Memory one pytest-xdist worker may take with its guard children at their peak (bytes). Source: session 30's
rehearsal with three workers on the 2-core, 23.5 GiB CI machine (``bench/results/cpu/
ci_session30_rehearsal2_three_workers_memory.log``): 21.5 GiB (22,011 MiB) in use at its peak, 2.0 GiB available."""


def auto_workers(cpus: int, memory_bytes: int) -> int:
    """How many workers ``-n auto`` starts: one per core, but no more than the machine's memory holds at
    :data:`WORKER_MEMORY_BYTES` each (at least one). A third worker on the 2-core CI machine brought it within
    2 GiB of the OOM killer and no faster (the rehearsal above); a many-core machine with little memory
    would lose workers to it (sessions 21-28 lost single workers so)."""
    return max(1, min(cpus, memory_bytes // WORKER_MEMORY_BYTES))


def pytest_xdist_auto_num_workers(config) -> int | None:
    """``-n auto``: :func:`auto_workers` of this machine (``PYTEST_XDIST_AUTO_NUM_WORKERS`` still wins)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist's own hook reads it
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return auto_workers(cpus, memory)


def pytest_terminal_summary(terminalreporter, config) -> None:
    """Under pytest-xdist, one line on what the machine locks cost: the time tests waited for them and held
    the machine alone (a core idles meanwhile), to see what the ``quiet`` tests cost the suite's wall time."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not hasattr(config, "_tmp_path_factory"):
        return
    log = config._tmp_path_factory.getbasetemp() / "machine-locks" / LOCK_LOG
    if not log.is_file():
        return
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    tot = {k: sum(r.get(k, 0.0) for r in rows)
           for k in ("shared_wait_s", "exclusive_wait_s", "exclusive_held_s", "children", "child_s")}
    worst = sorted(rows, key=lambda r: -(r.get("exclusive_wait_s", 0.0) + r.get("shared_wait_s", 0.0)))[:3]
    terminalreporter.write_line(
        f"machine locks: {len(rows)} tests waited {tot['shared_wait_s']:.0f} s at the turnstile; "
        f"{sum(r['quiet'] for r in rows)} quiet tests waited {tot['exclusive_wait_s']:.0f} s for the machine and held it "
        f"alone {tot['exclusive_held_s']:.0f} s; longest waits: "
        + ", ".join(f"{r['test']} {r.get('exclusive_wait_s', 0.0) + r.get('shared_wait_s', 0.0):.0f} s" for r in worst))
    terminalreporter.write_line(
        f"guard children: {tot['children']:.0f} started by the tests' own processes, {tot['child_s']:.0f} s of child "
        "wall time (children of workbench subprocesses not counted)")


CPU_GAIN_JUDGINGS = 3
"""Judgings at most of a candidate whose accept rests on a CPU perf gain, each pooled with the earlier ones
(``workbench/retries.py``), as a user re-runs: a later one only when perf alone rejected the earlier. The MoE good
fixture's gain at mini_t1 (~1.2x, calls of a few microseconds) is the noisiest: one judging's interval reached
below 1 in session 20 (1.275x, down to 0.93), session 25's landing CI (1.236x, 0.993) and, pooled over two,
in session 26's final rehearsal (1.228x, 0.987-1.532, ``bench/results/cpu/ci_session26.md``). Pooling narrows the
interval and does not move it: a real regression or a kernel at parity stays rejected."""

def gain_unconfirmed(failure) -> bool:
    """Whether ``failure`` (a result's first failing verdict, or ``None``) is perf finding a claimed gain not
    confirmed ("is no real gain"): the one failure :data:`CPU_GAIN_JUDGINGS` judges again. A regression is not."""
    return failure is not None and failure.guard == "perf" and "is no real gain" in failure.summary


SLOW_FIXTURES = frozenset({"template_repo", "cpu_run"})
"""Shared fixtures that judge a candidate in full (tests/review/conftest.py ``template_repo``) or run the
model bench (tests/workbench/test_bench_model.py ``cpu_run``): every test using one is ``slow`` (its first
use on a worker costs 30-160 s on the 2-core machine), so the quick tier never builds them."""


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Tests that use a :data:`SLOW_FIXTURES` fixture are marked ``slow``. Order: ``quiet`` tests, then the
    other ``slow`` ones, then the rest (stable: file order within each). Long jobs start early and quick ones
    fill the gaps at the end, so pytest-xdist workers finish together; and a quiet test's timing waits for
    the other worker's running test to end, which at the start of a session (``--dist worksteal`` hands
    the first worker the front of this list and the second the back, all quick tests) is a quick one.
    ``gpu`` tests skip by themselves on a machine without CUDA."""
    for it in items:
        if SLOW_FIXTURES & set(getattr(it, "fixturenames", ())):
            it.add_marker(pytest.mark.slow)
    items.sort(key=lambda it: 0 if it.get_closest_marker("quiet") else 1 if it.get_closest_marker("slow") else 2)
    gpu = [it for it in items if it.get_closest_marker("gpu") is not None]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (marked gpu); none is visible here")
        for it in gpu:
            it.add_marker(skip)


# ---- a shorter model eval where the model eval is not what a test is about -------------------------

SUITE_MODEL_EVAL = {"WORKBENCH_MODEL_EVAL_CONTEXT_TOKENS": "320", "WORKBENCH_MODEL_EVAL_GENERATE_TOKENS": "65",
                    "WORKBENCH_MODEL_EVAL_PREFILL_CHUNK": "128", "WORKBENCH_MODEL_EVAL_PAGE_TOKENS": "64",
                    "WORKBENCH_MODEL_EVAL_DTYPES": "float32", "WORKBENCH_MODEL_EVAL_SPEC_CONTEXT_TOKENS": "96",
                    "WORKBENCH_MODEL_EVAL_SPEC_GENERATE_TOKENS": "32"}
"""Model-eval lengths for tests that judge a candidate for another reason: the same structure as the
defaults at an eighth of the length. 320 context tokens span three KDA prefill chunks of 128 (two state
hand-overs), and 320 + 65 tokens cross from the prefill's 5th MLA page of 64 into a 6th, so decode runs
split-KV over 5-6 pages (``ModelEvalSettings.validate`` holds). A judgment's model eval costs about half
of what 1024 + 129 tokens in 512/256-token chunks and pages cost (11.0 s against 23.5 s for both legs of
k3_moe_dispatch perf-slower, seed 5, measured alone on the 2-core machine, 2026-12-04). They
judge float32 only: the bfloat16 leg (two more children, ~25-60 s on the loaded 2-core CI machine) is
judged by the model eval's own tests. The speculative leg (k3_dspark_verify) runs a 96-token prompt and 32
tokens per request instead of 192 and 64.
Tests of the model eval itself (``model_eval`` in the test id: its own tests, the ``model_eval-*``
fixtures) and the exploit corpus (its cases are tuned to the defaults) keep the defaults. The CLI's
subprocess tests (tests/workbench/test_cli.py ``wb``) pass these lengths on: they test the CLI's contract."""


@pytest.fixture(autouse=True)
def _suite_model_eval(request, monkeypatch) -> None:
    node = request.node.nodeid
    if "model_eval" in node:
        return
    if "tests/exploits/test_corpus.py" in node:  # the corpus's lengths are tuned to the defaults; bf16 is not its subject
        if "WORKBENCH_MODEL_EVAL_DTYPES" not in os.environ:
            monkeypatch.setenv("WORKBENCH_MODEL_EVAL_DTYPES", "float32")
        return
    use_suite_model_eval(monkeypatch)


def use_suite_model_eval(mp: pytest.MonkeyPatch) -> None:
    """Set the :data:`SUITE_MODEL_EVAL` lengths through ``mp``, except those the environment sets already."""
    for k, v in SUITE_MODEL_EVAL.items():
        if k not in os.environ:
            mp.setenv(k, v)


@pytest.fixture(autouse=True)
def _own_judgings_ledger(request, tmp_path_factory, monkeypatch) -> None:
    """Each test pools only its own judgings (``workbench.retries``): a candidate judged by two tests in
    one worker's session repository would otherwise be judged the second time with the first's evidence."""
    import hashlib

    digest = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:16]
    monkeypatch.setenv("WORKBENCH_JUDGINGS", str(tmp_path_factory.getbasetemp() / f"judgings-{digest}.jsonl"))


# ---- what the correctness guard derives from (task, seed), computed once per worker ------------------------
#
# The correctness guard's configurations and inputs are a deterministic function of (task, seed)
# (guards.cases.correctness_cases: what ``--seed`` reproduces), and the task's reference a pure function of
# its inputs. Tests that judge many candidates with one seed (the fixtures, one seed per task and worker;
# the exploit corpus, seed 1234) compute both once per worker and hand each judgment fresh copies: every
# candidate is judged on exactly the configurations, inputs and expected outputs a judgment of its own
# computes. The candidate's child runs, the checks of its outputs and every other guard run per candidate.
# On the 2-core machine this saves, per k3_dspark_verify judgment, ~10-20 s of building 40 configurations
# at V = 163840 (608 MiB of inputs) and ~15-30 s of their fp64 reference; ~3 s per k3_moe_dispatch one.

_CASES: dict[tuple, list] = {}
_REFERENCE: collections.OrderedDict = collections.OrderedDict()
REFERENCE_MEMO_ENTRIES = 1024
"""Most reference outputs kept per worker (an LRU): every configuration of every task for one seed."""


def _tensors(value) -> list:
    """Every tensor in a nest of lists, tuples, dicts and dataclasses (a list of cases)."""
    import dataclasses

    import torch

    out: list = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            stack.extend(getattr(v, f.name) for f in dataclasses.fields(v))
    return out


def _cases_once(real):
    """Each judgment gets its own copy of the cases' structure (lists, dicts, dataclasses) around the worker's one
    set of input tensors: small_m_gemm's inputs are 2 GB, and a deep copy per judgment doubled what a worker held
    (session 28's rehearsal 3 lost a worker to the kernel's OOM killer at 7.6 GB during a small_m_gemm judgment).
    The guards never write a case's tensors (they hand clones to the task's code and a serialized copy to the
    child); that stays checked: every shared tensor's in-place version counter is compared before each later
    use, and a moved one fails the test."""
    def correctness_cases(task, seed, *args, **kwargs):
        key = (task.model_dump_json(exclude={"root"}), seed, repr(args), repr(sorted(kwargs.items())))
        if key not in _CASES:
            _CASES.clear()  # one task's at a time: k3_dspark_verify's inputs alone are 608 MiB
            cases = real(task, seed, *args, **kwargs)
            tensors = _tensors(cases)
            _CASES[key] = (cases, tensors, [t._version for t in tensors])
        cases, tensors, versions = _CASES[key]
        moved = [i for i, t in enumerate(tensors) if t._version != versions[i]]
        assert not moved, (f"{len(moved)} input tensor(s) of the shared correctness cases were written in place by "
                           "an earlier judgment: the guards must hand clones to anything that writes")
        return copy.deepcopy(cases, memo={id(t): t for t in tensors})
    return correctness_cases


def _digest(value) -> str:
    """A content digest of a reference call's argument (tensors by dtype, shape and bytes)."""
    import torch

    h = hashlib.sha256()  # the fastest cryptographic hash here (guards._protocol.tensor_digest)

    def feed(v):
        if isinstance(v, torch.Tensor):
            t = v.detach().contiguous().cpu()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.view(-1).view(torch.uint8).numpy())  # the buffer itself: no bytes copy
        elif isinstance(v, dict):
            h.update(b"{")
            for k in sorted(v):
                h.update(repr(k).encode())
                feed(v[k])
            h.update(b"}")
        elif isinstance(v, (list, tuple)):
            h.update(b"[")
            for x in v:
                feed(x)
            h.update(b"]")
        else:
            h.update(f"{type(v).__name__}:{v!r}".encode())

    feed(value)
    return h.hexdigest()


_BY_IDENTITY: dict[tuple, tuple] = {}
"""(id, in-place version) of each tensor of a reference call -> (weak references to those tensors, the call's
content key): the judge hands the task's reference the worker's shared case tensors themselves
(``guards.cases.untouched``), so a call on the same unchanged tensors is known without hashing them again."""


def _content_key(module, inputs, kwargs) -> tuple:
    """The reference memo's key of a call: its content (by digest), found by the tensors' identity when they are
    the very tensors (alive, same in-place version) of an earlier call."""
    import weakref

    import torch

    tensors = sorted((k, v) for k, v in inputs.items() if isinstance(v, torch.Tensor))
    ident = (module.__file__, tuple((k, id(v), v._version) for k, v in tensors), _digest(kwargs),
             _digest({k: v for k, v in inputs.items() if not isinstance(v, torch.Tensor)}))
    hit = _BY_IDENTITY.get(ident)
    if hit is not None and all(ref() is v for ref, (_, v) in zip(hit[0], tensors)):
        return hit[1]
    key = (module.__file__, _digest(inputs), _digest(kwargs))
    _BY_IDENTITY[ident] = (tuple(weakref.ref(v) for _, v in tensors), key)
    while len(_BY_IDENTITY) > REFERENCE_MEMO_ENTRIES:
        _BY_IDENTITY.pop(next(iter(_BY_IDENTITY)))
    return key


_DIGESTS: dict[int, tuple] = {}
"""id(tensor) -> (weak reference, in-place version, digest) of the inputs the correctness guard digested."""


def _input_digest_once(real):
    """``guards.correctness.input_digest`` remembered per worker, not per judgment: the shared case tensors are
    the same objects in every judgment of a task and seed (``_cases_once``), so their digests are too while
    their in-place version counter stands (the guard's own memo rule)."""
    import weakref

    def input_digest(t, memo):
        hit = _DIGESTS.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        digest = real(t, memo)
        _DIGESTS[id(t)] = (weakref.ref(t), t._version, digest)
        if len(_DIGESTS) > 4 * REFERENCE_MEMO_ENTRIES:
            for k in [k for k, v in _DIGESTS.items() if v[0]() is None]:
                del _DIGESTS[k]
        return digest
    return input_digest


class _ReferenceOnce:
    """The task's reference module with ``reference`` computed once per distinct inputs and kwargs."""

    def __init__(self, module) -> None:
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def reference(self, inputs, kwargs):
        key = _content_key(self._module, inputs, kwargs)
        if key not in _REFERENCE:
            _REFERENCE[key] = self._module.reference(inputs, kwargs)
            while len(_REFERENCE) > REFERENCE_MEMO_ENTRIES:
                _REFERENCE.popitem(last=False)
        _REFERENCE.move_to_end(key)
        return copy.deepcopy(_REFERENCE[key])


def _reference_once(real):
    def load_task_module(task, name):
        mod = real(task, name)
        return _ReferenceOnce(mod) if name == "reference" else mod
    return load_task_module


# ---- the model eval's standard leg, run once per worker --------------------------------------------------------
#
# The model eval's standard child (decode_backend standard, greedy) never imports the candidate's kernel (checked
# on every real run) and runs code outside the task's allowed paths only; once isolation has passed, those files
# are the base commit's. So its outcome is a function of (base commit, task, device, seed-derived weights and
# prompts, settings, dtype): tests that judge many candidates of one task on one base with one seed (the
# fixtures) run it once per worker and hand each judgment a copy; each candidate's own child still runs in
# full. Not used by the exploit corpus (its judgments run every child) nor for the model_eval-* fixtures.
# Saves one child of two per judgment reaching the model eval: ~20-40 s on the 2-core machine.

_STANDARD_LEG: dict[tuple, object] = {}
STANDARD_LEG_ENTRIES = 8
"""Most standard-leg outcomes kept per worker (one per task, seed and dtype in a session)."""


def _standard_leg_once(real):
    def _run(self, ctx, backend, prompts, weights_seed, s, *args, **kwargs):
        if backend != "standard":
            return real(self, ctx, backend, prompts, weights_seed, s, *args, **kwargs)
        key = (ctx.base_commit, ctx.task.task_id, ctx.device, weights_seed, _digest(prompts),
               repr(dataclasses.asdict(s)), repr(args), repr(sorted(kwargs.items())))
        if key not in _STANDARD_LEG:
            out = real(self, ctx, backend, prompts, weights_seed, s, *args, **kwargs)
            if not (out.response and out.response.get("ok")):
                return out  # a failed run is not kept: the next judgment runs its own
            _STANDARD_LEG[key] = out
            while len(_STANDARD_LEG) > STANDARD_LEG_ENTRIES:
                _STANDARD_LEG.pop(next(iter(_STANDARD_LEG)))
        return copy.deepcopy(_STANDARD_LEG[key])
    return _run


@pytest.fixture
def model_eval_standard_once(monkeypatch) -> None:
    """The model eval's standard leg run once per worker and base (see above)."""
    import guards.model_eval

    monkeypatch.setattr(guards.model_eval.ModelEvalGuard, "_run",
                        _standard_leg_once(guards.model_eval.ModelEvalGuard._run))


@pytest.fixture
def correctness_derived_once(monkeypatch) -> None:
    """The correctness guard's cases and reference outputs computed once per worker (see above)."""
    import guards.correctness

    monkeypatch.setattr(guards.correctness, "correctness_cases", _cases_once(guards.correctness.correctness_cases))
    monkeypatch.setattr(guards.correctness, "load_task_module", _reference_once(guards.correctness.load_task_module))
    monkeypatch.setattr(guards.correctness, "input_digest", _input_digest_once(guards.correctness.input_digest))
