"""The one dispatcher of K3 ops: standard path or latency-specialized kernel, decided per call.

Latency-specialized runs only when the forward context's ``decode_backend`` is
``latency_specialized``, a kernel for the op is merged under ``k3_model/kernels/<op>/``, and the batch
(phase, batch size, device, dtype, TP size) lies inside the scope that kernel declares. Every decision
(op, implementation, reason) is logged and appended to the active trace, so a reviewer (and the
activation guard) can see when the fast path ran and why it fell back.

Source: DESIGN.md "K3 ops and the decode backend"; STYLE.md (vLLM's lesson: log which implementation runs).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import logging
from typing import Any, Callable, Iterator

logger = logging.getLogger("k3_model.dispatch")

STANDARD = "standard"
LATENCY_SPECIALIZED = "latency_specialized"


class DispatchError(RuntimeError):
    """A latency-specialized module exists but is malformed (no SCOPE, no entry point, import error)."""


@dataclasses.dataclass(frozen=True)
class OpScope:
    """The scope a latency-specialized kernel declares (what it was tested on).

    Attributes:
        devices: device types (``"cpu"``, ``"cuda"``).
        phases: batch phases it handles (``"decode"``).
        tp_sizes: tensor-parallel world sizes.
        dtypes: dtype names of the op's main input (``"float32"``, ``"bfloat16"``).
        batch_min, batch_max: inclusive decode batch range (requests).
    """

    devices: tuple[str, ...]
    phases: tuple[str, ...] = ("decode",)
    tp_sizes: tuple[int, ...] = (1,)
    dtypes: tuple[str, ...] = ("float32",)
    batch_min: int = 1
    batch_max: int = 64

    def covers(self, batch: "BatchInfo") -> tuple[bool, str]:
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
        """JSON-ready form."""
        return dataclasses.asdict(self)


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


def _specialized_module(op: str) -> Any | None:
    """Import ``k3_model.kernels.<op>`` once; ``None`` if no kernel for ``op`` is merged.

    Raises:
        DispatchError: the module exists but fails to import or lacks ``SCOPE`` / the entry point.
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
    except Exception as exc:  # the kernel module is code under test: surface what broke, never fall back
        raise DispatchError(f"{name}: import failed with {type(exc).__name__}: {exc}. Fix the kernel module.") from exc
    if getattr(mod, "__file__", None) is None:  # a folder without __init__.py: nothing merged yet
        logger.info("%s is a folder without __init__.py; no latency-specialized kernel for %s", name, op)
        _MODULES[op] = None
        return None
    scope = getattr(mod, "SCOPE", None)
    if not isinstance(scope, OpScope):
        raise DispatchError(
            f"{name}: SCOPE must be a k3_model.dispatch.OpScope declaring where the kernel runs; "
            f"got {type(scope).__name__}. Add SCOPE = OpScope(...)."
        )
    _MODULES[op] = mod
    return mod


def declared_scope(op: str) -> OpScope | None:
    """The scope the merged latency-specialized kernel for ``op`` declares, or ``None`` if none is merged."""
    mod = _specialized_module(op)
    return None if mod is None else mod.SCOPE


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
                ok, why = mod.SCOPE.covers(BatchInfo(phase, batch_size, device, dtype, tp))
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
