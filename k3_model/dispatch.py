"""The one dispatcher of K3 ops: standard path or latency-specialized kernel, decided per call.

Latency-specialized runs only when the forward context's ``decode_backend`` is
``latency_specialized``, a kernel for the op is merged under ``k3_model/kernels/<op>/``, and the batch
(phase, batch size, device, dtype, TP size) lies inside the scope that kernel declares. Every decision
(op, implementation, reason) is logged and appended to the active trace, so a reviewer (and the
activation guard) can see when the fast path ran and why it fell back.

A kernel's ``SCOPE`` is data, not code: an :class:`OpScope` or a plain ``dict`` literal whose fields
are plain tuples (or lists) of exact ``str``/``int`` and plain ``int`` batch bounds. The dispatcher reads
``SCOPE`` once per kernel module, when it is first imported, rebuilds it as a fresh :class:`OpScope`
(:func:`parse_scope`) and keeps that object: :func:`declared_scope` (what the guards check) and every
dispatch decision use the same parsed value, and nothing the kernel does to ``mod.SCOPE`` afterwards
changes either. Anything else (a tuple subclass, a custom container, a ``bool`` for an ``int``, an
``OpScope`` subclass) is a :class:`ScopeError`.

Source: DESIGN.md "K3 ops and the decode backend"; STYLE.md (vLLM's lesson: log which implementation runs);
issue 12 item 4 ("scope is data, not code").
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger("k3_model.dispatch")

STANDARD = "standard"
LATENCY_SPECIALIZED = "latency_specialized"


class DispatchError(RuntimeError):
    """A latency-specialized module exists but is malformed (no SCOPE, no entry point, import error)."""


class ScopeError(DispatchError):
    """A kernel's ``SCOPE`` is not plain data (wrong container or item type, bad batch range, unknown key)."""


_ITEM_FIELDS: dict[str, type] = {"devices": str, "phases": str, "tp_sizes": int, "dtypes": str}
"""OpScope's sequence fields and the exact type of their items."""
_INT_FIELDS = ("batch_min", "batch_max")
_EXAMPLES = {"devices": '("cpu",)', "phases": '("decode",)', "tp_sizes": "(1,)", "dtypes": '("float32",)',
             "batch_min": "1", "batch_max": "64"}


def _type_name(x: object) -> str:
    """``module.Qualname`` of ``x``'s type (never calls ``x``'s own ``__repr__``: it is candidate code)."""
    t = type(x)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _plain_items(field: str, value: object, item_type: type) -> tuple:
    """``value`` as a plain tuple, when it is exactly a ``tuple`` or ``list`` of exactly ``item_type``.

    Raises:
        ScopeError: another container (a subclass included: its ``__contains__``/``__iter__`` are code),
            an item of another type (a ``str``/``int`` subclass, ``bool``), or an empty sequence.
    """
    kind = item_type.__name__
    if type(value) not in (tuple, list):
        sub = " (a subclass of tuple/list: its __contains__ and __iter__ can disagree)" if isinstance(value, (tuple, list)) else ""
        raise ScopeError(f"OpScope field {field!r} must be a plain tuple of {kind}; got {_type_name(value)}{sub}. "
                         f"Write it as a literal, e.g. {field}={_EXAMPLES[field]}.")
    items = tuple(value)  # exact tuple/list: the builtin iteration, nothing the candidate defines
    for i, x in enumerate(items):
        if type(x) is not item_type:
            raise ScopeError(f"OpScope field {field!r} item {i} must be exactly {kind}; got {_type_name(x)}. "
                             f"Write plain literals, e.g. {field}={_EXAMPLES[field]}.")
    if not items:
        raise ScopeError(f"OpScope field {field!r} is empty, so the kernel could never run; list what it was "
                         f"tested on, e.g. {field}={_EXAMPLES[field]}.")
    return items


@dataclasses.dataclass(frozen=True)
class OpScope:
    """The scope a latency-specialized kernel declares (what it was tested on).

    Construction validates and normalises every field (``__post_init__``): sequence fields become plain
    tuples of exact ``str``/``int``, batch bounds must be exact ``int`` with 1 <= batch_min <= batch_max.

    Attributes:
        devices: device types (``"cpu"``, ``"cuda"``).
        phases: batch phases it handles (``"decode"``).
        tp_sizes: tensor-parallel world sizes.
        dtypes: dtype names of the op's main input (``"float32"``, ``"bfloat16"``).
        batch_min, batch_max: inclusive decode batch range (requests).

    Raises:
        ScopeError: a field is not plain data of its type, is empty, or the batch range is empty or below 1.
    """

    devices: tuple[str, ...]
    phases: tuple[str, ...] = ("decode",)
    tp_sizes: tuple[int, ...] = (1,)
    dtypes: tuple[str, ...] = ("float32",)
    batch_min: int = 1
    batch_max: int = 64

    def __post_init__(self) -> None:
        for field, item_type in _ITEM_FIELDS.items():
            object.__setattr__(self, field, _plain_items(field, getattr(self, field), item_type))
        for field in _INT_FIELDS:
            v = getattr(self, field)
            if type(v) is not int:
                raise ScopeError(f"OpScope field {field!r} must be exactly int; got {_type_name(v)}. "
                                 f"Write a plain literal, e.g. {field}={_EXAMPLES[field]}.")
        if not 1 <= self.batch_min <= self.batch_max:
            raise ScopeError(f"OpScope batch range [{self.batch_min}, {self.batch_max}] is empty or below 1; "
                             "declare 1 <= batch_min <= batch_max.")

    def covers(self, batch: BatchInfo) -> tuple[bool, str]:
        """Whether ``batch`` is inside this scope, and the reason in words."""
        checks = (
            (batch.phase in self.phases, f"phase {batch.phase!r} not in {list(self.phases)}"),
            (
                self.batch_min <= batch.batch_size <= self.batch_max,
                f"batch {batch.batch_size} outside [{self.batch_min}, {self.batch_max}]",
            ),
            (batch.device in self.devices, f"device {batch.device!r} not in {list(self.devices)}"),
            (batch.dtype in self.dtypes, f"dtype {batch.dtype!r} not in {list(self.dtypes)}"),
            (batch.tp_size in self.tp_sizes, f"TP size {batch.tp_size} not in {list(self.tp_sizes)}"),
        )
        for ok, why in checks:
            if not ok:
                return False, why
        return True, (
            f"in scope (phase {batch.phase}, batch {batch.batch_size}, {batch.device}, "
            f"{batch.dtype}, TP {batch.tp_size})"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (tuples stay tuples; the fields are plain data by construction)."""
        return dataclasses.asdict(self)


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(OpScope))


def parse_scope(raw: object, *, where: str = "SCOPE") -> OpScope:
    """A fresh, validated :class:`OpScope` from a kernel's ``SCOPE`` value.

    Args:
        raw: an exact :class:`OpScope` (not a subclass: ``covers`` would be its code) or an exact
            ``dict`` with ``str`` keys among the OpScope field names (``devices`` required).
        where: names the kernel in error messages, e.g. ``k3_model.kernels.moe_dispatch
            (k3_model/kernels/moe_dispatch/)``.

    Returns:
        A new OpScope (never ``raw`` itself), so later changes to ``raw`` change nothing.

    Raises:
        ScopeError: ``raw`` is neither, has unknown or missing keys, or a field is not plain data.
    """
    fix = 'Write SCOPE = OpScope(devices=("cpu",), ...) or a plain dict literal of tuples of str/int.'
    if type(raw) is OpScope:
        fields = {f: object.__getattribute__(raw, f) for f in _FIELD_NAMES}  # re-validated below
    elif type(raw) is dict:
        bad_keys = [k for k in raw if type(k) is not str or k not in _FIELD_NAMES]
        if bad_keys:
            raise ScopeError(f"{where}: SCOPE has key(s) that are not OpScope fields "
                             f"({', '.join(sorted(k if type(k) is str else _type_name(k) for k in bad_keys))}); "
                             f"expected keys among {', '.join(_FIELD_NAMES)}. Remove or rename them.")
        if "devices" not in raw:
            raise ScopeError(f"{where}: SCOPE lacks 'devices'; list the devices the kernel was tested on, "
                             'e.g. "devices": ("cpu",).')
        fields = dict(raw)
    else:
        what = "no SCOPE is defined" if raw is None else f"got {_type_name(raw)}"
        sub = " (a subclass of OpScope: its methods are code)" if isinstance(raw, OpScope) else ""
        raise ScopeError(f"{where}: SCOPE must be a k3_model.dispatch.OpScope or a plain dict declaring where "
                         f"the kernel runs; {what}{sub}. {fix}")
    try:
        return OpScope(**fields)
    except ScopeError as exc:
        raise ScopeError(f"{where}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class BatchInfo:
    """What the dispatcher knows about one call.

    Attributes:
        phase: ``decode`` (every request has query length 1, or 1 + D when verifying drafts),
            ``prefill``, ``mixed`` or ``unknown`` (no forward context).
        batch_size: requests in the batch.
        device: device type of the inputs.
        dtype: dtype name of the op's main input.
        tp_size: tensor-parallel world size.
    """

    phase: str
    batch_size: int
    device: str
    dtype: str
    tp_size: int


@dataclasses.dataclass(frozen=True)
class Decision:
    """One dispatch decision: which implementation ran for which op, and why."""

    op: str
    implementation: str
    reason: str
    batch_size: int
    phase: str
    device: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return dataclasses.asdict(self)


class DispatchTrace:
    """An append-only list of decisions (one per op call) recorded while active."""

    def __init__(self) -> None:
        self.decisions: list[Decision] = []

    def append(self, d: Decision) -> None:
        self.decisions.append(d)

    def implementations(self, op: str | None = None) -> list[str]:
        """Implementations chosen, in call order (for one op if given)."""
        return [d.implementation for d in self.decisions if op is None or d.op == op]


@dataclasses.dataclass(frozen=True)
class _Context:
    decode_backend: str
    phase: str
    tp_size: int


_CTX: contextvars.ContextVar[_Context | None] = contextvars.ContextVar("k3_forward_context", default=None)
_TRACES: contextvars.ContextVar[tuple[DispatchTrace, ...]] = contextvars.ContextVar("k3_traces", default=())


@contextlib.contextmanager
def forward_context(*, decode_backend: str, phase: str, tp_size: int = 1) -> Iterator[None]:
    """Declare the batch the next op calls belong to.

    Args:
        decode_backend: ``standard`` or ``latency_specialized``.
        phase: ``decode``, ``prefill`` or ``mixed``.
        tp_size: tensor-parallel world size.

    Raises:
        ValueError: an unknown backend or phase.
    """
    if decode_backend not in (STANDARD, LATENCY_SPECIALIZED):
        raise ValueError(
            f"forward_context: decode_backend {decode_backend!r} is not one of "
            f"{STANDARD!r}, {LATENCY_SPECIALIZED!r}; set the model's decode_backend to one of them."
        )
    if phase not in ("decode", "prefill", "mixed"):
        raise ValueError(f"forward_context: phase {phase!r} is not decode, prefill or mixed.")
    token = _CTX.set(_Context(decode_backend, phase, tp_size))
    try:
        yield
    finally:
        _CTX.reset(token)


@contextlib.contextmanager
def record_trace() -> Iterator[DispatchTrace]:
    """Record every dispatch decision made inside the block (nested recorders all receive them)."""
    trace = DispatchTrace()
    token = _TRACES.set(_TRACES.get() + (trace,))
    try:
        yield trace
    finally:
        _TRACES.reset(token)


_MODULES: dict[str, Any] = {}
"""op -> imported kernel module (``None``: nothing merged). guards/_child_main.py swaps entries while it
times the base commit's kernel, so a scope is looked up per module object, not per op."""
_SCOPES: dict[int, tuple[Any, OpScope]] = {}
"""id(module) -> (module, its parsed scope); the module is kept so its id is never reused while cached."""


def _where(op: str) -> str:
    return f"k3_model.kernels.{op} (k3_model/kernels/{op}/)"


def _scope_of(op: str, mod: Any) -> OpScope:
    """The parsed scope of kernel module ``mod``: ``mod.SCOPE`` is read and parsed once, then reused.

    Raises:
        ScopeError: ``mod.SCOPE`` is missing or not plain data.
    """
    hit = _SCOPES.get(id(mod))
    if hit is not None and hit[0] is mod:
        return hit[1]
    scope = parse_scope(getattr(mod, "SCOPE", None), where=_where(op))
    _SCOPES[id(mod)] = (mod, scope)
    return scope


def _specialized_module(op: str) -> Any | None:
    """Import ``k3_model.kernels.<op>`` once and parse its ``SCOPE``; ``None`` if no kernel for ``op`` is merged.

    Raises:
        ScopeError: ``SCOPE`` is missing or not plain data (also when an ``OpScope(...)`` in the module
            body rejects its arguments while the module is imported).
        DispatchError: the module exists but fails to import.
    """
    if op in _MODULES:
        return _MODULES[op]
    name = f"k3_model.kernels.{op}"
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name in (name, "k3_model.kernels"):
            _MODULES[op] = None
            return None
        raise DispatchError(f"{name}: import failed: {exc}. Fix the kernel module.") from exc
    except ScopeError as exc:  # OpScope(...) in the module body refused its fields
        raise ScopeError(f"{_where(op)}: invalid SCOPE while importing the kernel: {exc}") from None
    except Exception as exc:  # the kernel module is code under test: surface what broke, never fall back
        raise DispatchError(f"{name}: import failed with {type(exc).__name__}: {exc}. Fix the kernel module.") from exc
    if getattr(mod, "__file__", None) is None:  # a folder without __init__.py: nothing merged yet
        logger.info("%s is a folder without __init__.py; no latency-specialized kernel for %s", name, op)
        _MODULES[op] = None
        return None
    _scope_of(op, mod)  # parse now: a bad SCOPE fails at import, before any call
    _MODULES[op] = mod
    return mod


def declared_scope(op: str) -> OpScope | None:
    """The parsed scope of the merged latency-specialized kernel for ``op`` (the very object the
    dispatcher decides with), or ``None`` if none is merged.

    Raises:
        ScopeError, DispatchError: as :func:`_specialized_module`.
    """
    mod = _specialized_module(op)
    return None if mod is None else _scope_of(op, mod)


def select(op: str, entry: str, standard: Callable[..., Any], batch_size: int, device: str, dtype: str) -> Callable[..., Any]:
    """Pick the implementation of ``op`` for one call, record and log the decision.

    Args:
        op: the op name (also the kernel folder under ``k3_model/kernels/``).
        entry: the function name the latency-specialized module must define.
        standard: the standard-path implementation.
        batch_size: decode batch (requests) of this call.
        device: device type of the inputs.
        dtype: dtype name of the op's main input.

    Returns:
        The callable to run.

    Raises:
        DispatchError: a merged kernel module is malformed.
    """
    ctx = _CTX.get()
    if ctx is None:
        impl, reason, fn = STANDARD, "no forward context: batch phase unknown", standard
        phase, tp = "unknown", 1
    else:
        phase, tp = ctx.phase, ctx.tp_size
        if ctx.decode_backend == STANDARD:
            impl, reason, fn = STANDARD, "decode_backend is standard", standard
        else:
            mod = _specialized_module(op)
            if mod is None:
                impl, reason, fn = STANDARD, f"no latency-specialized kernel merged for {op}", standard
            else:
                ok, why = _scope_of(op, mod).covers(BatchInfo(phase, batch_size, device, dtype, tp))
                fn = getattr(mod, entry, None)
                if not callable(fn):
                    raise DispatchError(
                        f"k3_model.kernels.{op}: entry point {entry!r} is missing or not callable; "
                        f"define def {entry}(...) with the op's signature."
                    )
                if ok:
                    impl, reason = LATENCY_SPECIALIZED, why
                else:
                    impl, reason, fn = STANDARD, f"out of declared scope: {why}", standard
    decision = Decision(op, impl, reason, batch_size, phase, device)
    logger.debug("dispatch %s -> %s (%s)", op, impl, reason)
    for trace in _TRACES.get():
        trace.append(decision)
    return fn
