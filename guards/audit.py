"""Static audit guard: the candidate's source shows no known way to game the guards.

Reads every file the candidate adds or changes (the diff base..candidate, from git; candidate code is
never imported here): Python through its AST, CUDA/C++ sources (and string constants in Python, where
``load_inline`` sources live) as text. FAIL names ``file:line`` and the rule for each finding:

- ``forbidden-import``: threads, processes, FFI, sockets, signals, timers, introspection, file and
  harness modules (threading, multiprocessing, subprocess, ctypes, socket, time, inspect, gc,
  importlib, pytest, guards, workbench, tasks, ...);
- ``process-control`` / ``environment`` / ``file-access``: ``os.system``, ``os.fork``, ``os._exit``,
  ``os.kill``, ``os.environ``, ``os.getenv``, ``open()``, pathlib reads and writes, file-system probes
  (``exists``, ``is_file``, ``iterdir``, ``stat``, ``glob``, ``listdir``, ...);
- ``process-identity``: what tells the judge's child from a serving process: ``sys.flags``, ``sys.argv``,
  ``sys.executable``, ``os.getpid``/``getppid``/``getuid``/``getcwd``/``cpu_count``, ... (and the modules
  ``platform``, ``getpass``, ``pwd``, ``psutil``), and tensor internals such as ``._version`` (the judge
  refills its buffers in place, a model passes fresh activations), and where the code was loaded from
  (``__file__``, ``__spec__``, ...); a kernel computes the same thing in both, so it has no use for them
  (session 7's red team: ``sys.flags.isolated``, ``_version > 0``; session 10's: the checkout's shape);
- ``timer``: ``perf_counter``, ``monotonic``, ``torch.cuda.Event``, ``elapsed_time``; ``clock``: ``datetime``,
  ``calendar``, ``zoneinfo`` (a date tells today's judging from a later serving; ``uuid`` is process identity);
- ``side-stream``: creating or switching CUDA streams (work the timer's stream does not wait for);
- ``harness-reference``: names or strings pointing at the task's reference, the guards, the
  workbench, the standard path (``*_standard``) or the dispatcher's internals (anything from
  ``k3_model.dispatch`` but ``OpScope``), or the op's public entry (which dispatches back);
- ``monkeypatch``: assigning or deleting attributes of imported modules or their members, ``setattr``
  on them, ``sys.modules``, ``builtins``, ``exec``/``eval``/``__import__``, frame introspection;
- ``global-state``: a module-level container mutated inside a function with a key or value derived
  from the call's tensors (``data_ptr``, ``id``, ``hash``, ``shape``, ``clone``, an input or output
  name), ``global`` counters and other per-call state (``+=`` on module-level names, ``next()`` of a
  module-level iterator such as ``itertools.count``), and
  ``functools.cache``/``lru_cache`` on functions that take the op's tensors. State shared by every call
  is a module-level container or tensor (or one built by a function of the file), a container held by a
  module-level class or function (``_S.cache``), a name imported from the kernel's own package, or the
  object a cached function of the file hands every caller (``d = _state()``, however the cache is
  spelled: an alias, ``functools.cache(f)``), reached directly or through local names. Inside a function,
  on such state: an in-place update or a store computed from its own value (``d['n'] += 1``,
  ``_C[k] = _C.get(k, 0) + 1``), removing (``pop``, ``clear``: first-call flags), growing it by constants
  or from itself (``_CALLS.append(1)``, ``_seen.add_(1)``), ``next()`` on it, and stores or mutators whose key or value come
  from the call's tensors (an output cache) are findings (helper-37's and helper-40's red teams, session
  30). A workspace kept per size (``kept.append(torch.empty(n))``, ``ws[:] = 0``) and a read config table
  are not;
- ``mutable-default``: a mutable default argument of any function or lambda (a list, dict or set
  literal or comprehension; ``dict()``, ``list()``, ``set()``, ``bytearray()``, anything from
  ``collections``, ``SimpleNamespace()``; a tensor or array factory such as ``torch.zeros``; an instance
  of a class defined in the file; a module-level container): Python evaluates it once, so it is state
  kept across calls (``def f(x, _cache={})``, ``_n=[0]``) out of sight of the ``global-state`` rule;
- ``lazy-tensor``: tensor subclasses and ``__torch_function__``/``__torch_dispatch__`` hooks.

Compile caches keyed by dtype, block size or shape class (``x.shape[1]``, ``x.size(0)``: what CuTe DSL
and Triton kernels keep, e.g. ``kernels.cutedsl.CompileCache``) do not match these rules as long as the
stored value is built from no tensor, copy or tensor factory (a shape-keyed store of tensors is an
output cache, and still a finding), and neither does plain tensor code: the good fixtures must pass. ``None``, numbers,
strings, tuples, ``frozenset()`` and dtypes as defaults are immutable and never flagged. State held in
a closure built by a factory or on an object's attributes is not seen (it looks the same as a compile
cache or an autotuner's configuration); the runtime guards exist for what the source does not show.

Source: issue 7 ("Static audit guard"); DESIGN.md "Trust model".
"""

from __future__ import annotations

import ast
import dataclasses
import re

import git

from guards.base import GuardContext
from guards.verdict import Evidence, Status, Verdict

MAX_FINDINGS = 50
"""Findings kept as evidence (count)."""

PY_SUFFIXES = (".py", ".pyi")
NATIVE_SUFFIXES = (".cu", ".cuh", ".cpp", ".cc", ".cxx", ".c", ".h", ".hpp", ".hh")

FORBIDDEN_MODULES = {
    # threading and concurrent.futures are allowed: a pool started and joined inside the call is honest, and
    # the runtime layer (kernel thread census after every call, the judge's CPU clock of every thread)
    # fails threads left running; _thread stays refused (threads no Python-level join can track)
    "_thread": "threads", "multiprocessing": "processes",
    "subprocess": "processes", "pty": "processes", "ctypes": "FFI", "cffi": "FFI", "_ctypes": "FFI",
    "socket": "network", "ssl": "network", "http": "network", "urllib": "network", "requests": "network",
    "asyncio": "event loop", "signal": "signals", "faulthandler": "signals", "resource": "process limits",
    "fcntl": "file control", "mmap": "shared memory", "select": "fds", "selectors": "fds",
    "time": "timer", "timeit": "timer", "sched": "timer",
    # a date or clock tells today's judging from a later serving (session 13's red team: a kernel that drops
    # the selection bias from a date on); uuid1 carries the clock and the host
    "datetime": "clock", "calendar": "clock", "zoneinfo": "clock", "uuid": "process identity",
    "platform": "process identity", "getpass": "process identity", "pwd": "process identity",
    "grp": "process identity", "sysconfig": "process identity",
    "inspect": "introspection", "gc": "introspection", "tracemalloc": "introspection", "trace": "introspection",
    "importlib": "import machinery", "builtins": "builtins", "__builtin__": "builtins", "site": "import machinery",
    "sitecustomize": "import machinery", "usercustomize": "import machinery", "atexit": "exit hooks",
    "weakref": "caches", "shutil": "file access", "tempfile": "file access", "glob": "file access",
    "pickle": "file access", "marshal": "code objects", "shelve": "file access", "sqlite3": "file access",
    "pytest": "test harness", "_pytest": "test harness", "unittest": "test harness", "conftest": "test harness",
    "guards": "the guards", "workbench": "the workbench", "tasks": "the task reference", "tests": "the tests",
    "kernels.timing": "the timer", "kernels.stats": "the statistics", "git": "the repository", "psutil": "processes",
}
OS_CALLS = {
    **{n: "process-control" for n in (
        "system", "popen", "fork", "forkpty", "_exit", "abort", "kill", "killpg", "setsid", "setpgid", "setpgrp",
        "setuid", "setgid", "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
        "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "posix_spawn",
        "posix_spawnp", "register_at_fork", "nice", "sched_setaffinity", "pipe", "dup", "dup2", "wait", "waitpid")},
    **{n: "environment" for n in ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv")},
    **{n: "file-access" for n in (
        "open", "write", "read", "remove", "unlink", "rename", "renames", "replace", "symlink", "link", "mkdir",
        "makedirs", "rmdir", "removedirs", "chmod", "chown", "chdir", "truncate", "utime", "mkfifo", "listdir",
        "scandir", "walk", "fdopen")},
}
IDENTITY_SYS_ATTRS = {"flags", "argv", "orig_argv", "executable", "_base_executable", "_xoptions", "warnoptions",
                      "prefix", "base_prefix", "exec_prefix", "base_exec_prefix", "stdin", "__stdin__", "ps1",
                      "dont_write_bytecode", "_git", "implementation", "getrefcount"}
IDENTITY_OS_CALLS = {"getpid", "getppid", "getuid", "geteuid", "getgid", "getegid", "getgroups", "getlogin",
                     "getcwd", "getcwdb", "uname", "ttyname", "isatty", "getpgrp", "getpgid", "getsid",
                     "getpriority", "cpu_count", "process_cpu_count", "sched_getaffinity", "getloadavg", "times",
                     "getresuid", "getresgid", "get_terminal_size", "ctermid", "umask"}
"""What tells one process from another (interpreter flags, argv, pids, uid, cwd, cores, load): a kernel
computes the same thing in the judge's children as in a serving process, so it has no use for them."""
HOME_ATTRS = {"expanduser", "expandvars"}
"""``os.path`` calls that read the process environment (``HOME``, any ``$VAR``): the judge's children run with a
home of their own, so reading it tells them from a serving process (session 26's red team: a kernel that dropped the
selection bias unless ``~`` was a judge child's home was accepted). ``Path.home()`` is flagged with them."""
REEXPORTED_MODULES = {"os", "sys", "io", "_io", "gc", "builtins", "importlib", "inspect", "ctypes", "subprocess",
                      "posix", "threading", "signal", "socket", "time"}
"""Modules other modules re-export as attributes (``os.path.os``, ``torch.sys``, ``torch.os``): reaching one that
way passes every rule that names the module (session 26's review: ``torch.sys.modules["gc"]`` and
``os.path.os.environ`` had no finding). A kernel imports what it uses."""
MODULE_ACCESS_BASES = {"sys", "os", "io", "gc", "builtins", "importlib", "posixpath", "pathlib", "codecs",
                       "threading", "_io"}
"""Modules whose attributes ``getattr(module, ...)`` may not reach: every name the rules flag by attribute
(``sys.modules``, ``os.environ``, ``io.open``, ...) would be reached by a string (session 26's red team:
``getattr(sys, "modules")["gc"]`` found the garbage collector's state, which only the perf child turns off)."""
FILE_OPENERS = {("io", "open"), ("io", "open_code"), ("io", "FileIO"), ("_io", "open"), ("_io", "FileIO"),
                ("codecs", "open")}
"""``open`` under other names (session 26's red team read ``/proc/self/maps`` through ``io.open``)."""
IDENTITY_NAMES = {"os": IDENTITY_OS_CALLS, "sys": IDENTITY_SYS_ATTRS}
"""Module -> its names the ``process-identity`` rule flags."""
IDENTITY_TENSOR_ATTRS = {"_version", "_base", "_cdata", "_is_view", "_backward_hooks", "_python_dispatch"}
"""Tensor internals that tell the judge's buffers (refilled in place, version > 0) from a model's fresh
activations: a kernel's result and speed must not depend on them."""
SYS_ATTRS = {"modules", "_getframe", "settrace", "setprofile", "setrecursionlimit", "exit", "meta_path",
             "path_hooks", "path", "addaudithook", "_current_frames", "setswitchinterval", "stdout", "stderr",
             "__stdout__", "__stderr__", "excepthook", "breakpointhook"}
TIMER_ATTRS = {"perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns", "process_time", "process_time_ns",
               "thread_time", "thread_time_ns", "elapsed_time", "Event"}
STREAM_ATTRS = {"Stream", "stream", "set_stream", "ExternalStream", "StreamContext"}
FILE_METHODS = {"read_text", "read_bytes", "write_text", "write_bytes", "touch", "symlink_to", "hardlink_to",
                "mkdir", "unlink", "rmdir"}
FS_PROBE_METHODS = {"iterdir", "glob", "rglob", "is_file", "is_dir", "is_symlink", "is_mount", "exists", "lexists",
                    "stat", "lstat", "samefile", "listdir", "scandir", "walk", "isfile", "isdir", "islink",
                    "getsize", "getmtime", "getctime", "getatime", "fstat", "readlink", "realpath", "resolve"}
"""Calls that look at the file system around the kernel: what the checkout holds tells the judge's tree
from a serving one (session 10's red team: "is ``.git`` a file?"), and a kernel computes the same either way."""
LOCATION_NAMES = {"__file__", "__spec__", "__loader__", "__path__", "__cached__"}
"""Module attributes that say where the code was loaded from (a worktree, a clone, site-packages)."""
DANGEROUS_BUILTINS = {"open": "file-access", "exec": "monkeypatch", "eval": "monkeypatch", "compile": "monkeypatch",
                      "__import__": "monkeypatch", "globals": "monkeypatch", "vars": "monkeypatch",
                      "setattr": "monkeypatch", "delattr": "monkeypatch", "breakpoint": "process-control",
                      "input": "process-control"}
DUNDER_HOOKS = {"__torch_function__": "lazy-tensor", "__torch_dispatch__": "lazy-tensor",
                "_make_subclass": "lazy-tensor", "_make_wrapper_subclass": "lazy-tensor", "as_subclass": "lazy-tensor",
                "__globals__": "monkeypatch", "__code__": "monkeypatch", "__builtins__": "monkeypatch",
                "__dict__": "monkeypatch", "f_back": "monkeypatch", "f_locals": "monkeypatch",
                "f_globals": "monkeypatch", "tb_frame": "monkeypatch", "__subclasses__": "monkeypatch"}
CACHE_DECORATORS = {"cache", "lru_cache", "cached_property"}
KEY_MARKERS = {"data_ptr", "id", "hash", "tobytes", "storage", "untyped_storage", "tolist", "item", "numpy",
               "_version", "__hash__", "sum", "mean"}
"""Names that make a cache key depend on the call's tensors (identity or content)."""
VALUE_MARKERS = {"clone", "detach", "cpu", "copy", "deepcopy", "to"}
"""Names that make a stored value a copy of tensors (an output cache)."""
SAFE_TENSOR_ATTRS = {"dtype", "device", "is_cuda", "ndim", "layout", "is_contiguous"}
"""Tensor attributes a compile cache may key on."""
SHAPE_ATTRS = {"shape", "size", "dim", "numel", "ndimension"}
"""Tensor attributes that give a shape class (E, K, a batch size): a compile cache may key on them when
what it stores is not built from the call's tensors (no tensor, copy or tensor factory in the value)."""
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "add", "__setitem__", "appendleft", "put"}
INPLACE_ARITHMETIC = {"add_", "sub_", "mul_", "div_", "addcmul_", "addcdiv_", "pow_", "neg_"}
"""Tensor methods that update a tensor from its own value: on shared state with constant arguments, a counter
(``_seen.add_(1)``: helper-41's red team); ``copy_``, ``zero_`` and ``fill_`` (a workspace refilled) are not."""
REMOVERS = {"pop", "popitem", "clear", "remove", "discard", "popleft"}
"""Methods that take from a container: on state shared by every call, a first-call flag or a counter."""
CONTAINER_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "WeakValueDictionary",
                   "WeakKeyDictionary", "ChainMap"}
MUTABLE_DEFAULT_CALLS = CONTAINER_CALLS | {"bytearray", "SimpleNamespace", "UserDict", "UserList", "array"}
"""Calls that build a mutable object: as a default argument, one object shared by every call."""
MUTABLE_DEFAULT_MODULES = ("collections", "types.SimpleNamespace", "array", "queue", "weakref")
"""Modules (or members) whose call results are mutable containers."""
TENSOR_FACTORIES = {"tensor", "as_tensor", "asarray", "from_numpy", "zeros", "ones", "empty", "full", "arange",
                    "linspace", "rand", "randn", "randint", "zeros_like", "ones_like", "empty_like", "full_like",
                    "array", "Tensor", "FloatTensor", "LongTensor", "IntTensor", "empty_strided"}
"""Factories of tensors (torch) and arrays (numpy): mutable in place (``t += 1``, ``t[0] = x``)."""
SUSPICIOUS_STRINGS = (
    (re.compile(r"(^|/)tasks/|reference\.py|_wb_task_|(^|[/.])guards[/.]|(^|/)workbench/|\.workbench|"
                r"(^|/)\.git(/|$)|conftest|sitecustomize|\.pth$|/proc/|(^|/)\.\./"), "harness-reference"),
)
NATIVE_RULES = (
    (re.compile(r"\b(system|popen|fork|vfork|execv\w*|execl\w*|posix_spawn\w*|kill|_exit|abort)\s*\("), "process-control"),
    (re.compile(r"\b(fopen|freopen|open|creat|unlink|remove|rename|symlink|mkdir)\s*\("), "file-access"),
    (re.compile(r"\b(getenv|setenv|putenv|environ)\b"), "environment"),
    (re.compile(r"\bdlopen\b|\bdlsym\b"), "forbidden-import"),
    (re.compile(r"std::thread|\bpthread_create\b|std::async"), "forbidden-import"),
    (re.compile(r"\bcudaStreamCreate\w*|\bcudaStreamBeginCapture\b|\bcuStreamCreate\w*"), "side-stream"),
    (re.compile(r"\bcudaEvent(Record|ElapsedTime|Create)\w*|\bclock_gettime\b|\bgettimeofday\b|std::chrono"), "timer"),
    (re.compile(r"\bsocket\s*\(|\bconnect\s*\("), "forbidden-import"),
)


@dataclasses.dataclass(frozen=True)
class Finding:
    """One static finding: ``path:line`` broke ``rule`` because of ``why``."""

    path: str
    line: int
    rule: str
    why: str

    def evidence(self) -> Evidence:
        return Evidence(name=self.rule, value=self.why, path=f"{self.path}:{self.line}")


def _module_hit(name: str) -> str | None:
    """The forbidden module ``name`` falls under, or ``None``."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in FORBIDDEN_MODULES:
            return prefix
    return None


def _root_name(node: ast.AST) -> str | None:
    """``a`` for ``a.b.c``, ``a[0].b`` or ``a``; ``None`` for other expressions."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _dotted(node: ast.AST) -> str:
    """``torch.cuda.Event`` for an attribute chain (``?`` for parts that are not names)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    parts.append(node.id if isinstance(node, ast.Name) else "?")
    return ".".join(reversed(parts))


def _constant(node: ast.AST) -> bool:
    """Whether an expression is a constant (a literal, or a tuple/list/set/dict of them): what a counter
    stores, where a cache stores values built from the call."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(map(_constant, node.elts))
    if isinstance(node, ast.Dict):
        return all(k is None or _constant(k) for k in node.keys) and all(map(_constant, node.values))
    return isinstance(node, ast.UnaryOp) and _constant(node.operand)


def _names_in(node: ast.AST) -> set[str]:
    """Every identifier and attribute name used inside ``node``."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
    return out


class _PyAudit(ast.NodeVisitor):
    """Collects findings for one Python file."""

    def __init__(self, path: str, *, tensor_names: set[str], target_module: str, target_fn: str) -> None:
        self.path = path
        self.tensor_names = tensor_names
        self.target_module = target_module
        self.target_fn = target_fn
        self.findings: list[Finding] = []
        self.imported: dict[str, str] = {}  # local name -> module or module.member it is bound to
        self.module_containers: set[str] = set()
        self.module_names: set[str] = set()
        self.classes: set[str] = set()
        self.cached_functions: set[str] = set()  # module-level functions behind functools.cache / lru_cache
        self.module_defs: set[str] = set()  # module-level classes and functions (their attributes are module state)
        self.own_package_names: set[str] = set()  # names imported from the kernel's own package (``from . import x``)
        self.func_depth = 0
        self.locals_stack: list[set[str]] = []
        self.aliases: dict[str, ast.AST] = {}  # function-local name -> the value it was assigned

    def add(self, node: ast.AST, rule: str, why: str) -> None:
        self.findings.append(Finding(self.path, getattr(node, "lineno", 0), rule, why))

    # --- module-level facts -------------------------------------------------------------------
    def prescan(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.imported[(a.asname or a.name).split(".")[0] if not a.asname else a.asname] = a.name
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    self.imported[a.asname or a.name] = f"{node.module}.{a.name}"
            if isinstance(node, ast.ImportFrom) and (node.level or node.module == self.target_module
                                                     or (node.module or "").startswith(self.target_module + ".")):
                self.own_package_names |= {a.asname or a.name for a in node.names}
        self.classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.module_names.add(node.name)  # their attributes are module state too (``_S.n += 1``)
                self.module_defs.add(node.name)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    self._is_cache(d) for d in node.decorator_list):
                self.cached_functions.add(node.name)
            elif isinstance(node, ast.Assign) and self._cache_call(node.value):
                self.cached_functions |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        for node in tree.body:
            targets = []
            if isinstance(node, ast.Assign):
                targets, value = node.targets, node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value = [node.target], node.value
            else:
                continue
            for t in targets:
                if isinstance(t, ast.Name):
                    self.module_names.add(t.id)
                    if self._is_container(value) or (  # built by a function of this file: _C = _make_state()
                            isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                            and value.func.id in self.module_defs and value.func.id not in self.classes):
                        self.module_containers.add(t.id)

    def _is_cache(self, dec: ast.AST) -> bool:
        """Whether a decorator (or the callee of ``functools.cache(f)``) is ``functools.cache`` or
        ``lru_cache``, under any import name (``from functools import lru_cache as memo``)."""
        d = dec.func if isinstance(dec, ast.Call) and not (isinstance(dec.func, ast.Call)) else dec
        dotted = _dotted(d)
        root = dotted.split(".")[0]
        if root in self.imported:
            dotted = self.imported[root] + dotted[len(root):]
        return dotted in ("functools.cache", "functools.lru_cache") or (
            dotted in ("cache", "lru_cache") and root not in self.module_names)

    def _cache_call(self, value: ast.AST) -> bool:
        """Whether ``value`` wraps a function in a cache: ``functools.cache(f)``, ``lru_cache(None)(f)``."""
        if not isinstance(value, ast.Call):
            return False
        f = value.func
        return self._is_cache(f) or (isinstance(f, ast.Call) and self._is_cache(f.func))

    def _shared_state(self, node: ast.AST, depth: int = 0) -> str | None:
        """What state shared by every call of the op ``node`` is part of (words), or ``None``: a module-level
        container (``_C``, ``_C["k"]``), an attribute of a module-level class or function (``_S.cache``), the
        object a cached function hands every caller (``_state()``), reached directly or through local names."""
        attrs = 0
        while isinstance(node, (ast.Subscript, ast.Attribute)) or (  # an item: _C["k"], _C.get("k"), _C.setdefault(...)
                isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "setdefault", "__getitem__")):
            if isinstance(node, ast.Call):
                node = node.func
            attrs += isinstance(node, ast.Attribute) and node.attr not in ("get", "setdefault", "__getitem__")
            node = node.value
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in self.cached_functions \
                and not self._is_local(node.func.id):
            return f"the object {node.func.id}() caches"
        if not isinstance(node, ast.Name):
            return None
        if self._is_local(node.id):
            alias = self.aliases.get(node.id)
            return self._shared_state(alias, depth + 1) if alias is not None and depth < 4 else None
        if node.id in self.module_containers:
            return f"module-level {node.id}"
        if node.id in self.own_package_names:
            return f"{node.id} (imported from the kernel's own package)"  # another file's module state
        if node.id in self.module_defs and attrs:
            return f"an attribute of module-level {node.id}"
        return None

    def _reads_state(self, value: ast.AST | None, state: str) -> bool:
        """Whether ``value`` reads the shared state ``state`` (a read-modify-write: ``_C[k] = _C.get(k, 0) + 1``)."""
        return value is not None and any(
            isinstance(n, (ast.Name, ast.Attribute, ast.Subscript, ast.Call)) and self._shared_state(n) == state
            for n in ast.walk(value))

    @staticmethod
    def _is_container(value: ast.AST) -> bool:
        if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
            return True
        if isinstance(value, ast.Call):
            f = value.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            return name in CONTAINER_CALLS or (  # a module-level tensor is a container of numbers (``_N[0] += 1``)
                _dotted(f).split(".")[0] in ("torch", "numpy", "np") and name in TENSOR_FACTORIES)
        return False

    def _bare_names(self, node: ast.AST, depth: int = 0, safe: frozenset[str] | set[str] = SAFE_TENSOR_ATTRS) -> set[str]:
        """Names used in ``node`` (following local aliases), without tensors seen only through
        ``safe`` attributes such as ``x.dtype`` (the attribute names themselves are kept)."""
        out: set[str] = set()
        safe_roots = {id(n.value) for n in ast.walk(node)
                      if isinstance(n, ast.Attribute) and n.attr in safe}
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and id(n) not in safe_roots:
                out.add(n.id)
                if n.id in self.aliases and depth < 3:
                    out |= self._bare_names(self.aliases[n.id], depth + 1, safe)
            elif isinstance(n, ast.Attribute):
                out.add(n.attr)
        return out

    def _tensorish(self, node: ast.AST, markers: set[str], safe: frozenset[str] | set[str] = SAFE_TENSOR_ATTRS) -> str | None:
        """Why a key or value expression is derived from the call's tensors, or ``None``."""
        hit = sorted(self._bare_names(node, safe=safe) & (markers | self.tensor_names))
        return ", ".join(hit[:3]) if hit else None

    def _cache_store_why(self, key: ast.AST, value: ast.AST | None) -> str | None:
        """Why storing ``value`` under ``key`` in a module-level container is an output cache, or ``None``.

        A key from the tensors' identity or content (``data_ptr``, ``id``, ``item``, the tensor itself)
        is always one. A key from their dtype and shape class only (``x.dtype``, ``x.shape[1]``,
        ``x.size(0)``) is a compile cache when the stored value is built from no tensor, copy or tensor
        factory (``cute.compile(...)``, a kernel object); otherwise it caches outputs by shape.
        """
        why_key = self._tensorish(key, KEY_MARKERS)
        if why_key:
            if self._tensorish(key, KEY_MARKERS, safe=SAFE_TENSOR_ATTRS | SHAPE_ATTRS) is None and value is not None \
                    and self._tensorish(value, VALUE_MARKERS | TENSOR_FACTORIES, safe=SAFE_TENSOR_ATTRS | SHAPE_ATTRS) is None:
                return None
            return why_key
        return self._tensorish(value, VALUE_MARKERS) if value is not None else None

    def _is_local(self, name: str) -> bool:
        return bool(self.locals_stack) and name in self.locals_stack[-1]

    # --- imports --------------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            hit = _module_hit(a.name)
            if hit:
                self.add(node, "forbidden-import", f"import {a.name} ({FORBIDDEN_MODULES[hit]})")
            elif a.name == self.target_module:
                self.add(node, "harness-reference", f"import {a.name}: the op's module (its entry dispatches to the standard path)")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        if node.level:
            if any(a.name.endswith("_standard") for a in node.names):
                self.add(node, "harness-reference", "imports a standard-path function")
            return
        hit = _module_hit(mod)
        if hit:
            self.add(node, "forbidden-import", f"from {mod} import ... ({FORBIDDEN_MODULES[hit]})")
        for a in node.names:
            full = f"{mod}.{a.name}"
            sub = _module_hit(full)
            if sub and not hit:
                self.add(node, "forbidden-import", f"from {mod} import {a.name} ({FORBIDDEN_MODULES[sub]})")
            if mod == "os" and a.name in OS_CALLS:
                self.add(node, OS_CALLS[a.name], f"from os import {a.name}")
            if mod == "sys" and a.name in SYS_ATTRS:
                self.add(node, "monkeypatch", f"from sys import {a.name}")
            if a.name in IDENTITY_NAMES.get(mod, ()):
                self.add(node, "process-identity", f"from {mod} import {a.name}")
            if a.name in TIMER_ATTRS and mod.startswith(("time", "torch")):
                self.add(node, "timer", f"from {mod} import {a.name}")
            if mod == "k3_model.dispatch" and a.name not in ("OpScope", "DispatchError"):
                self.add(node, "harness-reference", f"from k3_model.dispatch import {a.name}: dispatcher internals "
                                                    "(a kernel imports only OpScope)")
            if a.name.endswith("_standard") or (mod == self.target_module and a.name == self.target_fn):
                self.add(node, "harness-reference", f"from {mod} import {a.name}: calls the standard path under another name")
            if mod == "functools" and a.name in CACHE_DECORATORS:
                pass  # judged where it decorates
            if a.name == "*":
                self.add(node, "harness-reference", f"from {mod} import *: hides what is used")

    # --- functions, classes ---------------------------------------------------------------------
    def _mutable_default(self, value: ast.AST) -> str | None:
        """What makes a default value mutable (words), or ``None`` for an immutable one."""
        kinds = {ast.List: "a list", ast.Dict: "a dict", ast.Set: "a set", ast.ListComp: "a list",
                 ast.DictComp: "a dict", ast.SetComp: "a set"}
        if type(value) in kinds:
            return f"{kinds[type(value)]} literal"
        if isinstance(value, ast.Tuple):  # an immutable tuple can still hold one shared mutable object
            inner = next(filter(None, map(self._mutable_default, value.elts)), None)
            return f"a tuple holding {inner}" if inner else None
        if isinstance(value, ast.Name) and value.id in self.module_containers:
            return f"the module-level container {value.id}"
        if not isinstance(value, ast.Call):
            return None
        f = value.func
        dotted = _dotted(f)
        root = dotted.split(".")[0]
        if root in self.imported:  # resolve import aliases: Counter -> collections.Counter
            dotted = self.imported[root] + dotted[len(root):]
        last = dotted.rsplit(".", 1)[-1]
        if isinstance(f, ast.Name) and f.id in self.classes:
            return f"an instance of {f.id}, a class of this file"
        if last in MUTABLE_DEFAULT_CALLS or any(dotted == m or dotted.startswith(m + ".") for m in MUTABLE_DEFAULT_MODULES):
            return f"{dotted}()"
        if dotted.split(".")[0] in ("torch", "numpy", "np") and last in TENSOR_FACTORIES:
            return f"a tensor ({dotted}())"
        return None

    def _check_defaults(self, node, name: str) -> None:
        args = node.args
        positional = [*args.posonlyargs, *args.args]
        pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
        pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
        for arg, default in pairs:
            why = self._mutable_default(default)
            if why:
                self.add(default, "mutable-default",
                         f"default argument {arg.arg}= of {name} is {why}: created once and shared by every "
                         "call, so it keeps state across calls of the op")

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._check_defaults(node, "a lambda")
        self.generic_visit(node)

    def _visit_function(self, node) -> None:
        self._check_defaults(node, f"{node.name}()")
        params = {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)}
        if node.args.vararg:
            params.add(node.args.vararg.arg)
        if node.args.kwarg:
            params.add(node.args.kwarg.arg)
        for dec in node.decorator_list:
            d = dec.func if isinstance(dec, ast.Call) else dec
            name = d.attr if isinstance(d, ast.Attribute) else d.id if isinstance(d, ast.Name) else ""
            if (name in CACHE_DECORATORS or self._is_cache(dec)) and (node.name == self.target_fn
                                                                      or params & self.tensor_names):
                self.add(dec, "global-state", f"@{name} on {node.name}() caches results across calls of the op")
        local = set(params)
        globals_declared = set()
        for n in ast.walk(node):
            if isinstance(n, ast.Global):
                globals_declared |= set(n.names)
            elif isinstance(n, (ast.Name,)) and isinstance(n.ctx, ast.Store):
                local.add(n.id)
        local -= globals_declared
        self.locals_stack.append(local)
        saved_aliases = self.aliases
        self.aliases = dict(saved_aliases)
        self.func_depth += 1
        self.generic_visit(node)
        self.func_depth -= 1
        self.aliases = saved_aliases
        self.locals_stack.pop()

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for b in node.bases:
            dotted = _dotted(b)
            if dotted.endswith("Tensor") or dotted.endswith("TorchFunctionMode") or dotted.endswith("TorchDispatchMode"):
                self.add(node, "lazy-tensor", f"class {node.name}({dotted}): tensor subclasses and modes can compute on read")
        self.generic_visit(node)

    def visit_Global(self, node: ast.Global) -> None:
        for name in node.names:
            self.add(node, "global-state", f"global {name}: state kept across calls of the op")

    # --- statements -----------------------------------------------------------------------------
    def _check_store_target(self, target: ast.AST, value: ast.AST | None, node: ast.AST, aug: bool) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for t in target.elts:
                self._check_store_target(t, None, node, aug)
            return
        state = self._shared_state(target.value) if self.func_depth and isinstance(
            target, (ast.Attribute, ast.Subscript)) else None
        if state and (aug or self._reads_state(value, state)):
            what = f"attribute .{target.attr}" if isinstance(target, ast.Attribute) else "an item"
            self.add(node, "global-state", f"updates {what} of {state} inside a function, from its own value: "
                                           "per-call counter or cache")
        elif isinstance(target, ast.Attribute):
            root = _root_name(target)
            if root in self.imported or root in ("sys", "builtins", "__builtins__"):
                self.add(node, "monkeypatch", f"assigns {_dotted(target)}: patches an imported module or class")
            elif root in self.module_names and self.func_depth and not self._is_local(root):
                self.add(node, "global-state", f"assigns {_dotted(target)} inside a function: state kept across calls "
                                               "(a compile cache belongs in a module-level dict keyed by dtype and shape)")
            elif root == self.target_fn or (root and root in self.module_names and aug):
                self.add(node, "global-state", f"updates {_dotted(target)}: state kept across calls")
        elif isinstance(target, ast.Subscript):
            root = _root_name(target)
            if root in ("sys", "builtins", "__builtins__") or (root and self.imported.get(root, "").startswith("sys")):
                self.add(node, "monkeypatch", f"assigns into {root}: patches interpreter state")
            elif state and not state.startswith("the object"):
                why = self._cache_store_why(target.slice, value)
                if why:
                    self.add(node, "global-state", f"stores into {state} keyed or filled from the call's tensors "
                                                   f"({why}): an output cache")
        elif isinstance(target, ast.Name) and aug and self.func_depth and not self._is_local(target.id) \
                and target.id in self.module_names:
            self.add(node, "global-state", f"updates module-level {target.id}: per-call counter")
        elif isinstance(target, ast.Name) and aug and self.func_depth and (state := self._shared_state(target)):
            self.add(node, "global-state", f"updates {state} in place through {target.id}: per-call counter or cache")

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._check_store_target(t, node.value, node, aug=False)
            if isinstance(t, ast.Name) and self.func_depth:
                self.aliases[t.id] = node.value
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self._check_store_target(node.target, node.value, node, aug=False)
            if isinstance(node.target, ast.Name) and self.func_depth:
                self.aliases[node.target.id] = node.value
        self.generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        if self.func_depth:
            self.aliases[node.target.id] = node.value
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._check_store_target(node.target, node.value, node, aug=True)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for t in node.targets:
            if isinstance(t, ast.Attribute) and _root_name(t) in self.imported:
                self.add(node, "monkeypatch", f"deletes {_dotted(t)} from an imported module")
        self.generic_visit(node)

    # --- expressions ----------------------------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        if isinstance(f, ast.Name) and f.id in DANGEROUS_BUILTINS and not self._is_local(f.id) \
                and f.id not in self.imported and f.id not in self.module_names:
            self.add(node, DANGEROUS_BUILTINS[f.id], f"calls {f.id}()")
        if isinstance(f, ast.Attribute) and f.attr in INPLACE_ARITHMETIC and self.func_depth \
                and (state := self._shared_state(f.value)) and all(
                    _constant(a) or self._reads_state(a, state) for a in [*node.args, *(k.value for k in node.keywords)]):
            self.add(node, "global-state", f".{f.attr}() on {state} inside a function, by constants or its own value: "
                                           "a per-call counter")
        if isinstance(f, ast.Attribute) and f.attr in MUTATORS | REMOVERS \
                and self.func_depth and (state := self._shared_state(f.value)):
            args = [*node.args, *(k.value for k in node.keywords)]
            if f.attr in ("setdefault", "__setitem__") and len(node.args) == 2 and not node.keywords \
                    and not self._reads_state(node.args[1], state):
                why = self._cache_store_why(node.args[0], node.args[1])  # (key, value), as a subscript store
                if why:
                    self.add(node, "global-state", f".{f.attr}(...) on {state} with values from the call's tensors "
                                                   f"({why}): an output cache")
            elif f.attr in REMOVERS or any(self._reads_state(a, state) for a in args) or all(map(_constant, args)):
                # removing (first-call flags, eviction), growing from itself or by constants: a per-call counter
                self.add(node, "global-state", f".{f.attr}() on {state} inside a function: state kept across calls "
                                               "(a per-call counter or cache)")
            else:
                why = next(filter(None, (self._tensorish(a, KEY_MARKERS | VALUE_MARKERS) for a in args)), None)
                if why:  # a buffer built from shapes (a workspace kept per size) is not flagged
                    self.add(node, "global-state", f".{f.attr}(...) on {state} with values from the call's tensors "
                                                   f"({why}): an output cache")
        if isinstance(f, ast.Attribute):
            root = _root_name(f)
            if f.attr in FILE_METHODS and root not in self.tensor_names:
                self.add(node, "file-access", f"calls .{f.attr}()")
            elif f.attr in FS_PROBE_METHODS and root not in self.tensor_names:
                self.add(node, "file-access", f"calls .{f.attr}(): probes the file system around the kernel")
        if isinstance(f, ast.Name) and f.id in ("getattr", "hasattr") and not self._is_local(f.id) and node.args \
                and isinstance(node.args[0], ast.Name):
            mod = self.imported.get(node.args[0].id, "").split(".")[0]
            if mod in MODULE_ACCESS_BASES:
                self.add(node, "monkeypatch", f"calls {f.id}({node.args[0].id}, ...): reaches {mod}'s attributes by "
                                              "a string, past the rules that name them")
        if isinstance(f, ast.Name) and f.id == "next" and self.func_depth and node.args \
                and (state := self._shared_state(node.args[0])):
            self.add(node, "global-state", f"next() on {state}: state kept across calls")
        elif isinstance(f, ast.Name) and f.id == "next" and self.func_depth and node.args \
                and isinstance(node.args[0], ast.Name) and node.args[0].id in self.module_names \
                and not self._is_local(node.args[0].id):
            self.add(node, "global-state", f"next({node.args[0].id}) on a module-level iterator: state kept across calls")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        root = _root_name(node)
        bound = self.imported.get(root or "", root or "")
        dotted = _dotted(node)
        if root and dotted.startswith(root + ".") and root in self.imported:
            dotted = bound + dotted[len(root):]  # resolve import aliases: dispatch.select -> k3_model.dispatch.select
        base = bound.split(".")[0] if bound else ""
        if node.attr in REEXPORTED_MODULES and isinstance(node.value, (ast.Name, ast.Attribute)) \
                and (root in self.imported or root in ("torch", "numpy", "np")):
            self.add(node, "monkeypatch", f"uses {dotted}: reaches the {node.attr} module through another one, past "
                                          "the rules that name it")
        elif isinstance(node.value, ast.Name) and node.attr in IDENTITY_NAMES.get(base, ()):
            self.add(node, "process-identity", f"uses {dotted}: tells the judge's child from a serving process")
        elif node.attr in IDENTITY_TENSOR_ATTRS:
            self.add(node, "process-identity", f"uses .{node.attr}: tells the judge's refilled buffers from fresh "
                                               "activations")
        elif base == "os" and node.attr in OS_CALLS and isinstance(node.value, ast.Name):
            self.add(node, OS_CALLS[node.attr], f"uses {dotted}")
        elif node.attr in HOME_ATTRS or (node.attr == "home" and dotted.endswith("Path.home")):
            self.add(node, "environment", f"uses {dotted}: reads the process environment (HOME and other variables)")
        elif (base, node.attr) in FILE_OPENERS:
            self.add(node, "file-access", f"uses {dotted}")
        elif base == "sys" and node.attr in SYS_ATTRS and isinstance(node.value, ast.Name):
            self.add(node, "monkeypatch", f"uses {dotted}")
        elif node.attr in TIMER_ATTRS and (node.attr != "Event" or base == "torch"):
            self.add(node, "timer", f"uses {dotted}")
        elif node.attr in STREAM_ATTRS and base == "torch":
            self.add(node, "side-stream", f"uses {dotted}: work on another stream escapes the timer")
        elif node.attr in DUNDER_HOOKS:
            self.add(node, DUNDER_HOOKS[node.attr], f"uses {dotted}")
        elif node.attr.endswith("_standard") or (node.attr == self.target_fn and dotted.startswith(self.target_module)):
            self.add(node, "harness-reference", f"uses {dotted}: the standard path under another name")
        elif dotted.startswith("k3_model.dispatch.") and node.attr not in ("OpScope", "DispatchError"):
            self.add(node, "harness-reference", f"uses {dotted}: dispatcher internals")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in ("__builtins__",) or node.id.endswith("_standard"):
            rule = "monkeypatch" if node.id == "__builtins__" else "harness-reference"
            self.add(node, rule, f"uses {node.id}")
        elif node.id in LOCATION_NAMES:
            self.add(node, "process-identity", f"uses {node.id}: where the code was loaded from tells the judge's "
                                               "tree from a serving one")
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return  # a docstring or bare string is inert
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str):
            for rx, rule in SUSPICIOUS_STRINGS:
                if rx.search(node.value):
                    self.add(node, rule, f"string {node.value[:60]!r} points at the harness or outside the kernel")
            if len(node.value) > 40 and ("__global__" in node.value or "#include" in node.value):
                for f in _native_findings(self.path, node.value, line_offset=node.lineno - 1):
                    self.findings.append(f)


def _native_findings(path: str, text: str, *, line_offset: int = 0) -> list[Finding]:
    """Text rules for CUDA/C++ sources (comments stripped first)."""
    out = []
    stripped = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    for i, line in enumerate(stripped.splitlines(), 1):
        code = line.split("//", 1)[0]
        for rx, rule in NATIVE_RULES:
            m = rx.search(code)
            if m:
                out.append(Finding(path, i + line_offset, rule, f"native source uses {m.group(0).strip()!r}"))
    return out


def audit_python(path: str, source: str, *, tensor_names: set[str], target: str) -> list[Finding]:
    """Findings for one Python file.

    Args:
        path: repo-relative path (for evidence).
        source: the file's text.
        tensor_names: the op's input and output names (keys from them mark an output cache).
        target: the task's target, ``module:function``.

    Returns:
        Findings in line order; a file that does not parse is one finding (``syntax``).
    """
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        return [Finding(path, exc.lineno or 0, "syntax", f"does not parse: {exc.msg}")]
    mod, _, fn = target.partition(":")
    v = _PyAudit(path, tensor_names=tensor_names, target_module=mod, target_fn=fn)
    v.prescan(tree)
    v.visit(tree)
    seen, out = set(), []
    for f in sorted(v.findings, key=lambda f: (f.line, f.rule)):
        if (f.line, f.rule, f.why) not in seen:
            seen.add((f.line, f.rule, f.why))
            out.append(f)
    return out


def audit_file(path: str, data: bytes, *, tensor_names: set[str], target: str) -> list[Finding]:
    """Findings for one changed file, by suffix (other files are isolation's concern)."""
    text = data.decode("utf-8", "replace")
    if path.endswith(PY_SUFFIXES):
        return audit_python(path, text, tensor_names=tensor_names, target=target)
    if path.endswith(NATIVE_SUFFIXES):
        return _native_findings(path, text)
    return []


class AuditGuard:
    """Reads the candidate's changed sources from git; never imports them."""

    name = "audit"
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()

    def check(self, ctx: GuardContext) -> Verdict:
        repo = git.Repo(ctx.repo_root)
        base, cand = repo.commit(ctx.base_commit), repo.commit(ctx.candidate_commit)
        tensor_names = set(ctx.task.inputs) | set(ctx.task.outputs)
        findings: list[Finding] = []
        audited = 0
        for d in base.diff(cand):
            if d.b_blob is None or d.b_blob.mode == 0o120000:
                continue
            path = d.b_path
            if not path.endswith(PY_SUFFIXES + NATIVE_SUFFIXES):
                continue
            audited += 1
            findings += audit_file(path, d.b_blob.data_stream.read(), tensor_names=tensor_names, target=ctx.task.target)
        if findings:
            f = findings[0]
            return Verdict(
                guard=self.name, status=Status.FAIL,
                summary=f"{len(findings)} finding(s) in the candidate's source; first: {f.path}:{f.line} [{f.rule}] {f.why}.",
                evidence=tuple(x.evidence() for x in findings[:MAX_FINDINGS]),
            )
        return Verdict(
            guard=self.name, status=Status.PASS,
            summary=f"No known gaming pattern in the {audited} changed source file(s).",
            evidence=(Evidence(name="files_audited", value=audited, unit="count"),),
        )
