"""The one dispatcher of K3 ops: standard path or latency-specialized kernel, decided per call.

Latency-specialized runs only when the forward context's ``decode_backend`` is
``latency_specialized``, a kernel for the op is merged under ``k3_model/kernels/<op>/``, and the step
(phase, requests, query length, token rows, device, dtype, TP size) lies inside the scope that kernel
declares. Every decision
(op, implementation, reason) is logged and appended to the active trace, so a reviewer (and the
activation guard) can see when the fast path ran and why it fell back.

A kernel's ``SCOPE`` is data, not code: an :class:`OpScope` or a plain ``dict`` literal whose fields
are plain tuples (or lists) of exact ``str``/``int`` and plain ``int`` bounds. The dispatcher reads
``SCOPE`` once per kernel module, when it is first imported, rebuilds it as a fresh :class:`OpScope`
(:func:`parse_scope`) and keeps that object: :func:`declared_scope` (what the guards check) and every
dispatch decision use the same parsed value, and nothing the kernel does to ``mod.SCOPE`` afterwards
changes either. Anything else (a tuple subclass, a custom container, a ``bool`` for an ``int``, an
``OpScope`` subclass) is a :class:`ScopeError`.

**Requests and query length.** A scope counts requests and query tokens per request, not token rows
(issue 21; docs/scope-requests.md): a decode step has query length 1, a speculative verification step
(phase ``spec_verify``) 1 + D for D draft tokens, so "decode batch 1-64 with 7 draft tokens" is
``requests_min=1, requests_max=64, query_len_min=1, query_len_max=8, phases=("decode", "spec_verify")``.
The caller that knows the step (the decode loop, the vLLM plugin, the guards' child) states its requests
and query length in :func:`forward_context`; an op reports only its token rows. The old row bounds
``batch_min``/``batch_max`` are a :class:`ScopeError` that names their replacements.

**Shapes.** A scope may also declare the shapes a kernel supports, per shape axis of the op (named as
the task's axes: moe_dispatch ``E``, ``K``, ``G``, ``TG``, ``B``; dspark_verify ``D``, ``V``, ``Q``;
allreduce_rmsnorm ``D``), as plain rules: ``shapes={"D": {"multiple_of": 8, "max": 4096}}`` (keys
``choices``, ``min``, ``max``, ``multiple_of``; a value is inside when it meets every rule of its axis).
An axis the scope does not name means "every value of the judged domain". Independently of any scope,
each op registers the shape domain its task judges (:func:`register_op_shapes`, from the op module, a
mirror of the task's ``[domain.axes]`` a test keeps equal), and a call outside it never reaches a
kernel: no kernel was judged there. Either refusal routes the call to the standard path, and the
logged reason names the axis, its value and the declared set (:func:`route`, the one rule the
dispatcher and the activation guard share).

Source: DESIGN.md "K3 ops and the decode backend"; STYLE.md (vLLM's lesson: log which implementation runs);
issue 12 item 4 ("scope is data, not code").
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger("k3_model.dispatch")

STANDARD = "standard"
LATENCY_SPECIALIZED = "latency_specialized"


class DispatchError(RuntimeError):
    """A latency-specialized module exists but is malformed (no SCOPE, no entry point, import error)."""


class ScopeError(DispatchError):
    """A kernel's ``SCOPE`` is not plain data (wrong container or item type, bad request or query-length
    range, unknown or old-style key)."""


PHASES = ("decode", "spec_verify", "prefill", "mixed")
"""Step phases: ``decode`` (query length 1 per request), ``spec_verify`` (1 + D query tokens per request:
the target model verifying D draft tokens), ``prefill``, ``mixed`` (prefill and decode rows together).
Source: vLLM's step kinds (docs/scope-requests.md)."""

OLD_BATCH_FIELDS = ("batch_min", "batch_max")
OLD_BATCH_FIX = ("batch_min/batch_max counted token rows; declare requests_min/requests_max (requests in the step) and "
                 "query_len_min/query_len_max (query tokens per request: 1 on decode, 1 + D when verifying D draft "
                 'tokens, with "spec_verify" in phases). Rows 1-64 of a decode step are requests_min=1, requests_max=64, '
                 "query_len_min=1, query_len_max=1 (docs/scope-requests.md).")
"""The error text for a scope that still names the row bounds of before issue 21."""


_ITEM_FIELDS: dict[str, type] = {"devices": str, "phases": str, "tp_sizes": int, "dtypes": str}
"""OpScope's sequence fields and the exact type of their items."""
_INT_FIELDS = ("requests_min", "requests_max", "query_len_min", "query_len_max")
_OPTIONAL_INT_FIELDS = ("rows_max",)
_EXAMPLES = {"devices": '("cpu",)', "phases": '("decode",)', "tp_sizes": "(1,)", "dtypes": '("float32",)',
             "requests_min": "1", "requests_max": "64", "query_len_min": "1", "query_len_max": "8", "rows_max": "128",
             "shapes": '{"D": {"multiple_of": 8}}'}
SHAPE_RULES = ("choices", "min", "max", "multiple_of")
"""The keys of one axis's shape rule, in the order they are checked and written."""


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


def _shape_int(where: str, x: object) -> int:
    if type(x) is not int or x < 1:
        raise ScopeError(f"{where} must be a plain int >= 1 (a size); got "
                         f"{x if type(x) is int else _type_name(x)}. Write e.g. shapes={_EXAMPLES['shapes']}.")
    return x


def _rule_misses(axis: str, value: int, rule: dict) -> str | None:
    """Why ``value`` of ``axis`` breaks ``rule`` (a normalised shape rule), or ``None`` when it meets it."""
    if "choices" in rule and value not in rule["choices"]:
        return f"{axis} {value} not in {list(rule['choices'])}"
    if "min" in rule and value < rule["min"]:
        return f"{axis} {value} below {rule['min']}"
    if "max" in rule and value > rule["max"]:
        return f"{axis} {value} above {rule['max']}"
    if "multiple_of" in rule and value % rule["multiple_of"]:
        return f"{axis} {value} not a multiple of {rule['multiple_of']}"
    return None


def shape_rule_admits(rule: dict, value: int) -> bool:
    """Whether ``value`` meets every entry of one normalised shape rule (``OpScope.shapes[axis]``)."""
    return _rule_misses("", value, rule) is None


def _plain_shapes(value: object) -> dict[str, dict[str, Any]]:
    """A fresh, normalised copy of an ``OpScope.shapes`` value (see :class:`OpScope`).

    Raises:
        ScopeError: not an exact dict of exact ``str`` axis names to exact dicts of known rule keys with
            plain ``int`` values (``choices``: a non-empty tuple/list of ints), a ``min`` above ``max``, or
            rules no size meets.
    """
    if type(value) is not dict:
        sub = " (a subclass of dict: its methods are code)" if isinstance(value, dict) else ""
        raise ScopeError(f"OpScope field 'shapes' must be a plain dict of axis name -> rule dict; got "
                         f"{_type_name(value)}{sub}. Write e.g. shapes={_EXAMPLES['shapes']}.")
    out: dict[str, dict[str, Any]] = {}
    for axis, rule in dict(value).items():
        if type(axis) is not str or not axis.isidentifier():
            raise ScopeError(f"OpScope shapes: axis name {axis!r} must be a plain str naming one of the op's shape "
                             f"axes (the task's [axes] names, e.g. 'D'); got {_type_name(axis)}.")
        where = f"OpScope shapes[{axis!r}]"
        if type(rule) is not dict or not rule:
            raise ScopeError(f"{where} must be a non-empty plain dict with keys among {', '.join(SHAPE_RULES)}; got "
                             f"{'an empty dict' if type(rule) is dict else _type_name(rule)}. "
                             f"Write e.g. shapes={_EXAMPLES['shapes']}.")
        unknown = [k for k in rule if type(k) is not str or k not in SHAPE_RULES]
        if unknown:
            raise ScopeError(f"{where} has unknown key(s) {sorted(map(str, unknown))}; expected keys among "
                             f"{', '.join(SHAPE_RULES)}.")
        norm: dict[str, Any] = {}
        for key in SHAPE_RULES:
            if key not in rule:
                continue
            if key == "choices":
                items = rule[key]
                if type(items) not in (tuple, list) or not items:
                    raise ScopeError(f"{where}['choices'] must be a non-empty plain tuple of int; got "
                                     f"{_type_name(items)}{' (empty)' if type(items) in (tuple, list) else ''}.")
                norm[key] = tuple(dict.fromkeys(_shape_int(f"{where}['choices'] item {i}", x)
                                                for i, x in enumerate(tuple(items))))
            else:
                norm[key] = _shape_int(f"{where}[{key!r}]", rule[key])
        if norm.get("min", 1) > norm.get("max", norm.get("min", 1)):
            raise ScopeError(f"{where}: min {norm['min']} is above max {norm['max']}; the kernel could never run.")
        if "choices" in norm and not any(shape_rule_admits(norm, c) for c in norm["choices"]):
            raise ScopeError(f"{where}: no listed choice meets the other rules {norm}; the kernel could never run.")
        m, lo = norm.get("multiple_of", 1), norm.get("min", 1)
        if "max" in norm and (-(-lo // m)) * m > norm["max"]:
            raise ScopeError(f"{where}: no multiple of {m} lies in [{lo}, {norm['max']}]; the kernel could never run.")
        out[axis] = norm
    return out


@dataclasses.dataclass(frozen=True)
class OpScope:
    """The scope a latency-specialized kernel declares (what it was tested on).

    Construction validates and normalises every field (``__post_init__``): sequence fields become plain
    tuples of exact ``str``/``int``, bounds must be exact ``int`` with 1 <= requests_min <= requests_max and
    1 <= query_len_min <= query_len_max.

    Attributes:
        devices: device types (``"cpu"``, ``"cuda"``).
        phases: step phases it handles, among :data:`PHASES` (``"decode"``, ``"spec_verify"``).
        tp_sizes: tensor-parallel world sizes.
        dtypes: dtype names of the op's main input (``"float32"``, ``"bfloat16"``).
        requests_min, requests_max: inclusive range of requests in a step (count).
        query_len_min, query_len_max: inclusive range of query tokens per request (count): 1 on decode,
            1 + D on a verification step with D draft tokens. Above 1 only with ``"spec_verify"`` in
            ``phases``, and ``"spec_verify"`` only with ``query_len_max`` >= 2.
        rows_max: most token rows of one call (count), or ``None``: ``requests x query length`` bounds
            them. For a kernel whose cost or workspace follows the rows, not the requests: e.g. requests
            1-64 at query length 1-8 with ``rows_max=128`` runs every decode step and verification steps of
            up to 16 requests at 7 drafts.
        shapes: optional per-axis shape rules, ``{axis: {"choices": (...), "min": n, "max": n,
            "multiple_of": n}}`` (any non-empty subset of the keys, plain ints >= 1); a call's axis value is
            inside when it meets every rule of its axis. Axis names are the op's shape axes (the task's
            axis names; requests, query length and the TP world size have their own fields): they are checked
            against the op's registered axes when the dispatcher reads the scope. ``{}`` (the default):
            every shape of the judged domain.

    Raises:
        ScopeError: a field is not plain data of its type, is empty, a phase is unknown, a range is empty or
            below 1, query length and phases disagree, or a shape rule is malformed (unknown key, not an int, ``min`` above ``max``, admits no size).
    """

    devices: tuple[str, ...]
    phases: tuple[str, ...] = ("decode",)
    tp_sizes: tuple[int, ...] = (1,)
    dtypes: tuple[str, ...] = ("float32",)
    requests_min: int = 1
    requests_max: int = 64
    query_len_min: int = 1
    query_len_max: int = 1
    rows_max: int | None = None
    shapes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        for field, item_type in _ITEM_FIELDS.items():
            object.__setattr__(self, field, _plain_items(field, getattr(self, field), item_type))
        for field in _INT_FIELDS:
            v = getattr(self, field)
            if type(v) is not int:
                raise ScopeError(f"OpScope field {field!r} must be exactly int; got {_type_name(v)}. "
                                 f"Write a plain literal, e.g. {field}={_EXAMPLES[field]}.")
        if self.rows_max is not None and (type(self.rows_max) is not int or self.rows_max < 1):
            raise ScopeError(f"OpScope field 'rows_max' must be None or an int >= 1; got "
                             f"{self.rows_max if type(self.rows_max) is int else _type_name(self.rows_max)}. "
                             f"Write a plain literal, e.g. rows_max={_EXAMPLES['rows_max']}.")
        unknown = [p for p in self.phases if p not in PHASES]
        if unknown:
            raise ScopeError(f"OpScope phases {unknown} are not step phases; expected some of {list(PHASES)}.")
        if not 1 <= self.requests_min <= self.requests_max:
            raise ScopeError(f"OpScope requests range [{self.requests_min}, {self.requests_max}] is empty or below 1; "
                             "declare 1 <= requests_min <= requests_max.")
        if not 1 <= self.query_len_min <= self.query_len_max:
            raise ScopeError(f"OpScope query length range [{self.query_len_min}, {self.query_len_max}] is empty or "
                             "below 1; declare 1 <= query_len_min <= query_len_max (1 on decode, 1 + D when verifying).")
        if self.query_len_max > 1 and "spec_verify" not in self.phases:
            raise ScopeError(f"OpScope query_len_max {self.query_len_max} needs \"spec_verify\" in phases (only "
                             f"verification steps have more than one query token per request); got phases "
                             f"{list(self.phases)}. Add \"spec_verify\" or set query_len_max=1.")
        if "spec_verify" in self.phases and self.query_len_max < 2:
            raise ScopeError("OpScope lists \"spec_verify\" but query_len_max is 1; a verification step has 1 + D "
                             ">= 2 query tokens per request. Set query_len_max (e.g. 8 for 7 draft tokens).")
        object.__setattr__(self, "shapes", _plain_shapes(self.shapes))

    def covers(self, batch: BatchInfo) -> tuple[bool, str]:
        """Whether ``batch`` is inside this scope, and the reason in words."""
        checks = (
            (batch.phase in self.phases, f"phase {batch.phase!r} not in {list(self.phases)}"),
            (
                self.requests_min <= batch.requests <= self.requests_max,
                f"requests {batch.requests} outside [{self.requests_min}, {self.requests_max}]",
            ),
            (
                self.query_len_min <= batch.query_len <= self.query_len_max,
                f"query length {batch.query_len} outside [{self.query_len_min}, {self.query_len_max}]",
            ),
            (
                batch.rows <= batch.requests * batch.query_len,
                f"{batch.rows} token rows exceed requests x query length = {batch.requests} x {batch.query_len}",
            ),
            (
                self.rows_max is None or batch.rows <= self.rows_max,
                f"{batch.rows} token rows above rows_max {self.rows_max}",
            ),
            (batch.device in self.devices, f"device {batch.device!r} not in {list(self.devices)}"),
            (batch.dtype in self.dtypes, f"dtype {batch.dtype!r} not in {list(self.dtypes)}"),
            (batch.tp_size in self.tp_sizes, f"TP size {batch.tp_size} not in {list(self.tp_sizes)}"),
        )
        for ok, why in checks:
            if not ok:
                return False, why
        for axis, rule in self.shapes.items():
            if axis not in batch.shapes:
                return False, (f"shape axis {axis} is declared in SCOPE.shapes but the call reports only "
                               f"{sorted(batch.shapes)}")
            miss = _rule_misses(axis, batch.shapes[axis], rule)
            if miss is not None:
                return False, f"shape {miss} (SCOPE.shapes[{axis!r}] = {rule})"
        shapes = "".join(f", {a} {v}" for a, v in batch.shapes.items())
        return True, (
            f"in scope (phase {batch.phase}, requests {batch.requests}, query length {batch.query_len}, "
            f"rows {batch.rows}, {batch.device}, "
            f"{batch.dtype}, TP {batch.tp_size}{shapes})"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (tuples stay tuples; the fields are plain data by construction). ``shapes`` is
        left out when empty and ``rows_max`` when ``None`` (a scope without them reads as it did before)."""
        out = dataclasses.asdict(self)
        if not out["shapes"]:
            del out["shapes"]
        if out["rows_max"] is None:
            del out["rows_max"]
        return out


_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(OpScope))


def parse_scope(raw: object, *, where: str = "SCOPE", op: str | None = None) -> OpScope:
    """A fresh, validated :class:`OpScope` from a kernel's ``SCOPE`` value.

    Args:
        raw: an exact :class:`OpScope` (not a subclass: ``covers`` would be its code) or an exact
            ``dict`` with ``str`` keys among the OpScope field names (``devices`` required).
        where: names the kernel in error messages, e.g. ``k3_model.kernels.moe_dispatch
            (k3_model/kernels/moe_dispatch/)``.
        op: the op the scope belongs to; when given, every axis in ``shapes`` must be one of the op's
            registered shape axes (:func:`register_op_shapes`).

    Returns:
        A new OpScope (never ``raw`` itself), so later changes to ``raw`` change nothing.

    Raises:
        ScopeError: ``raw`` is neither, has unknown or missing keys, a field is not plain data, or
            ``shapes`` names an axis the op does not have (or the op registered no shape axes).
    """
    fix = 'Write SCOPE = OpScope(devices=("cpu",), ...) or a plain dict literal of tuples of str/int.'
    if type(raw) is OpScope:
        fields = {f: object.__getattribute__(raw, f) for f in _FIELD_NAMES}  # re-validated below
    elif type(raw) is dict:
        old = [k for k in OLD_BATCH_FIELDS if k in raw]
        if old:
            raise ScopeError(f"{where}: SCOPE names {', '.join(old)}: {OLD_BATCH_FIX}")
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
        scope = OpScope(**fields)
    except ScopeError as exc:
        raise ScopeError(f"{where}: {exc}") from None
    if op is not None and scope.shapes:
        axes = op_shape_domain(op)
        if axes is None:
            raise ScopeError(f"{where}: SCOPE declares shapes {sorted(scope.shapes)} but op {op!r} registered no shape "
                             "axes (k3_model/ops/<op>.py register_op_shapes); remove 'shapes' from SCOPE.")
        unknown = sorted(set(scope.shapes) - set(axes))
        if unknown:
            raise ScopeError(f"{where}: SCOPE.shapes names axis(es) {unknown} that op {op!r} does not have; its shape "
                             f"axes are {list(axes)} (the task's axis names; requests, query length and the TP size are "
                             "requests_min/requests_max, query_len_min/query_len_max and tp_sizes). Rename or remove them.")
    return scope


_OP_SHAPES: dict[str, dict[str, dict[str, Any]]] = {}
"""op -> {shape axis: normalised rule of the judged domain}, filled by the op modules at import."""


def register_op_shapes(op: str, domain: dict[str, dict[str, Any]]) -> None:
    """Declare the shape axes of ``op`` and the domain of each that its task judges (called once by
    ``k3_model/ops/<op>.py`` at import).

    Args:
        op: the op name.
        domain: axis name -> rule in the ``OpScope.shapes`` language (``choices``/``min``/``max``/
            ``multiple_of``); a mirror of the task's ``[domain.axes]`` (tests/k3_model/test_dispatch_shapes.py
            keeps them equal). A call whose axes fall outside it never runs a kernel.

    Raises:
        ScopeError: a malformed rule (as :class:`OpScope` ``shapes``), or ``op`` registered twice with
            another domain.
    """
    norm = _plain_shapes(domain)
    if op in _OP_SHAPES and _OP_SHAPES[op] != norm:
        raise ScopeError(f"register_op_shapes: op {op!r} is already registered with {_OP_SHAPES[op]}; got {norm}.")
    _OP_SHAPES[op] = norm
    _ROUTES.clear()


def op_shape_domain(op: str) -> dict[str, dict[str, Any]] | None:
    """The judged shape domain ``op`` registered (axis -> rule, a copy), or ``None`` if it registered none."""
    dom = _OP_SHAPES.get(op)
    return None if dom is None else {a: dict(r) for a, r in dom.items()}


@dataclasses.dataclass(frozen=True)
class BatchInfo:
    """What the dispatcher knows about one call.

    Attributes:
        phase: one of :data:`PHASES` (``decode``: query length 1; ``spec_verify``: 1 + D), or ``unknown``
            (no forward context).
        requests: requests in the step (count; the forward context's, else the call's token rows).
        query_len: query tokens per request (count; the largest in the step: 1 on decode, 1 + D on
            verification).
        rows: token rows of the op's main input in this call (count). At most ``requests x query_len``
            (an op called per request or per query position sees fewer).
        device: device type of the inputs.
        dtype: dtype name of the op's main input.
        tp_size: tensor-parallel world size.
        shapes: the op's shape axes of this call (axis name -> size, e.g. ``{"D": 7168}``); ``{}`` when
            the op reports none.
    """

    phase: str
    requests: int
    query_len: int
    rows: int
    device: str
    dtype: str
    tp_size: int
    shapes: dict[str, int] = dataclasses.field(default_factory=dict, hash=False)


@dataclasses.dataclass(frozen=True)
class Decision:
    """One dispatch decision: which implementation ran for which op, and why."""

    op: str
    implementation: str
    reason: str
    rows: int
    phase: str
    device: str
    requests: int
    query_len: int

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
    requests: int | None
    query_len: int


_CTX: contextvars.ContextVar[_Context | None] = contextvars.ContextVar("k3_forward_context", default=None)
_TRACES: contextvars.ContextVar[tuple[DispatchTrace, ...]] = contextvars.ContextVar("k3_traces", default=())


@contextlib.contextmanager
def forward_context(*, decode_backend: str, phase: str, tp_size: int = 1, requests: int | None = None,
                    query_len: int | None = None) -> Iterator[None]:
    """Declare the step the next op calls belong to.

    Args:
        decode_backend: ``standard`` or ``latency_specialized``.
        phase: one of :data:`PHASES`.
        tp_size: tensor-parallel world size.
        requests: requests in the step (count). ``None``: each call's token rows (exact for a decode step
            whose ops see the whole batch, one row per request); required for ``spec_verify``.
        query_len: query tokens per request (count; the largest in the step). ``None``: 1 for ``decode``
            (the only value it may have) and for ``prefill``/``mixed`` (whose scopes rarely list them);
            required, >= 2, for ``spec_verify``.

    Raises:
        ValueError: an unknown backend or phase, a count below 1, a ``decode`` step with query length
            above 1, or a ``spec_verify`` step without ``requests`` or with query length below 2.
    """
    if decode_backend not in (STANDARD, LATENCY_SPECIALIZED):
        raise ValueError(
            f"forward_context: decode_backend {decode_backend!r} is not one of "
            f"{STANDARD!r}, {LATENCY_SPECIALIZED!r}; set the model's decode_backend to one of them."
        )
    if phase not in PHASES:
        raise ValueError(f"forward_context: phase {phase!r} is not one of {list(PHASES)}.")
    for name, v in (("requests", requests), ("query_len", query_len)):
        if v is not None and (type(v) is not int or v < 1):
            raise ValueError(f"forward_context: {name} must be an int >= 1 (a count); got {v!r}.")
    if phase == "decode" and query_len not in (None, 1):
        raise ValueError(f"forward_context: a decode step has query length 1; got {query_len}. A step verifying "
                         "draft tokens is phase='spec_verify'.")
    if phase == "spec_verify" and (requests is None or query_len is None or query_len < 2):
        raise ValueError(f"forward_context: a spec_verify step needs requests and query_len >= 2 (1 + D draft tokens); "
                         f"got requests={requests!r}, query_len={query_len!r}.")
    token = _CTX.set(_Context(decode_backend, phase, tp_size, requests, query_len or 1))
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
""":func:`kernel_key` (``op``, or ``op.device`` for a device subpackage) -> imported kernel module
(``None``: nothing merged). guards/_child_main.py swaps entries while it times the base commit's kernel,
so a scope is looked up per module object, not per op."""
KERNEL_DEVICES = ("cpu", "cuda")
"""Device types that may have their own kernel subpackage ``k3_model/kernels/<op>/<device>/``."""
_KEYS: dict[tuple[str, str], str] = {}
"""(op, device) -> :func:`kernel_key`'s answer, looked up once per process."""
_SCOPES: dict[int, tuple[Any, OpScope]] = {}
"""id(module) -> (module, its parsed scope); the module is kept so its id is never reused while cached."""
_ROUTES: dict[tuple, tuple[OpScope, str, str]] = {}
""":func:`select`'s memo of :func:`route`: (op, id(scope), whether a stand-in routes, phase, requests, query length, rows, device, dtype,
TP size, shape items)
-> (the scope, the implementation, its reason: a stand-in's too, :class:`StandardRoutedAsKernel`). A decode step
calls each op with the same few keys, and the scope
checks with their reasons cost ~10 us a call on the 2-core CI machine (a 576 x 19 GEMM at M = 2: 26.9 us
through a merged kernel against 16.7 us on the standard path, measured 2026-12-04), more than a
decode-size kernel gains on CPU. The scope is kept so its id is never reused while cached; the memo is
emptied when an op registers its shapes and when it reaches :data:`_ROUTES_MAX` entries."""
_ROUTES_MAX = 4096
"""Most memoised routes (count); a random-shape sweep empties the memo rather than growing it."""


def _where(op: str) -> str:
    return f"k3_model.kernels.{op} (k3_model/kernels/{op}/)"


def route(op: str, scope: OpScope, batch: BatchInfo) -> tuple[bool, str]:
    """Whether a call ``batch`` of ``op`` runs the kernel whose parsed scope is ``scope``, and why: the
    one rule the dispatcher (:func:`select`) and the activation guard use.

    First the op's judged shape domain (:func:`register_op_shapes`: no kernel was judged outside it),
    then the kernel's own scope (``OpScope.covers``: phase, requests, query length, rows, device, dtype, TP
    size, ``shapes``).

    Returns:
        ``(True, "in scope (...)")`` or ``(False, reason)``; a reason names the field or axis, the
        value and the declared set.
    """
    for axis, rule in (_OP_SHAPES.get(op) or {}).items():
        if axis not in batch.shapes:
            return False, f"shape axis {axis} of {op} was not reported by the call (reported: {sorted(batch.shapes)})"
        miss = _rule_misses(axis, batch.shapes[axis], rule)
        if miss is not None:
            return False, (f"outside the judged shape domain: {miss} (k3_model.ops.{op} SHAPE_DOMAIN, the task's "
                           f"[domain.axes.{axis}]); no kernel was judged there")
    ok, why = scope.covers(batch)
    return ok, why if ok else f"out of declared scope: {why}"


def _scope_of(op: str, mod: Any) -> OpScope:
    """The parsed scope of kernel module ``mod``: ``mod.SCOPE`` is read and parsed once, then reused.

    Raises:
        ScopeError: ``mod.SCOPE`` is missing or not plain data.
    """
    hit = _SCOPES.get(id(mod))
    if hit is not None and hit[0] is mod:
        return hit[1]
    if type(mod) is StandardRoutedAsKernel:  # parsed already: its constructor takes parse_scope's result
        scope = mod.SCOPE
    else:
        scope = parse_scope(getattr(mod, "SCOPE", None), where=_where(op), op=op)
    _SCOPES[id(mod)] = (mod, scope)
    return scope


def kernel_key(op: str, device: str | None = None) -> str:
    """Which kernel package serves ``op`` on device type ``device``: ``"<op>.<device>"`` when the
    subpackage ``k3_model/kernels/<op>/<device>/`` (an ``__init__.py``) exists, else ``"<op>"`` (the op's
    package itself). One op can so hold a CPU kernel and a CUDA kernel, each judged on its own device:
    a subpackage's SCOPE must list its device only (:func:`_specialized_module`), and the activation
    guard lets a candidate judged on one device change only the files that serve that device.

    Args:
        op: the op name (its folder under ``k3_model/kernels/``).
        device: ``"cpu"``, ``"cuda"``, another device type (never a subpackage), or ``None`` (the op's
            package).
    """
    if device not in KERNEL_DEVICES:
        return op
    hit = _KEYS.get((op, device))
    if hit is None:
        import k3_model.kernels as pkg

        hit = op
        for root in getattr(pkg, "__path__", ()):
            if os.path.isfile(os.path.join(root, op, device, "__init__.py")):
                hit = f"{op}.{device}"
                break
        _KEYS[(op, device)] = hit
    return hit


def _specialized_module(op: str, device: str | None = None) -> Any | None:
    """Import the kernel package serving ``op`` on ``device`` (:func:`kernel_key`) once and parse its
    ``SCOPE``; ``None`` if no kernel for ``op`` is merged.

    Raises:
        ScopeError: ``SCOPE`` is missing or not plain data (also when an ``OpScope(...)`` in the module
            body rejects its arguments while the module is imported), or a device subpackage's SCOPE
            lists other devices than its own.
        DispatchError: the module exists but fails to import.
    """
    key = kernel_key(op, device)
    if key in _MODULES:
        return _MODULES[key]
    name = f"k3_model.kernels.{key}"
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name in (name, "k3_model.kernels"):
            _MODULES[key] = None
            return None
        raise DispatchError(f"{name}: import failed: {exc}. Fix the kernel module.") from exc
    except ScopeError as exc:  # OpScope(...) in the module body refused its fields
        raise ScopeError(f"{_where(op)}: invalid SCOPE while importing the kernel: {exc}") from None
    except Exception as exc:  # the kernel module is code under test: surface what broke, never fall back
        raise DispatchError(f"{name}: import failed with {type(exc).__name__}: {exc}. Fix the kernel module.") from exc
    if getattr(mod, "__file__", None) is None:  # a folder without __init__.py: nothing merged yet
        logger.info("%s is a folder without __init__.py; no latency-specialized kernel for %s", name, op)
        _MODULES[key] = None
        return None
    scope = _scope_of(op, mod)  # parse now: a bad SCOPE fails at import, before any call
    if key != op and tuple(scope.devices) != (device,):
        raise ScopeError(f"k3_model.kernels.{key} (k3_model/kernels/{op}/{device}/): a device subpackage's SCOPE "
                         f"lists devices {list(scope.devices)}; it serves {device!r} only, so its SCOPE must say "
                         f"devices=({device!r},).")
    logger.info("%s on %s: kernel package k3_model.kernels.%s", op, device or "any device", key)
    _MODULES[key] = mod
    return mod


class StandardRoutedAsKernel:
    """A stand-in kernel module: :func:`select` routes a call through it as through a merged kernel with
    the same ``SCOPE`` (module cache, scope check, route cache, entry lookup) and then runs the op's
    standard implementation, recorded as ``standard``.

    The perf guard times its baseline through one when no kernel is merged at the base, so both timed
    sides pay the same dispatch and the comparison is of the implementations alone. The kernel route
    (forward context included) cost 1.8-2.9 us more per call than the ``decode_backend=standard`` route on
    the 2-core CI machine, which made a kernel that runs the standard computation on tiny GEMMs read
    0.90-0.97x (the landing CI of session 22's work rejected one at 0.876x); through the stand-in it reads 0.99-1.00x.
    Source: ``bench/dispatch_route_overhead.py``, ``bench/results/cpu/dispatch_route_overhead_session23.json``.

    Args:
        scope: the scope to route with (the candidate's parsed ``SCOPE``), an :class:`OpScope`.
    """

    def __init__(self, scope: OpScope):
        if type(scope) is not OpScope:
            raise TypeError(f"StandardRoutedAsKernel(scope): expected an OpScope (parse_scope's result), got "
                            f"{type(scope).__name__}")
        self.SCOPE = scope


def declared_scope(op: str, device: str | None = None) -> OpScope | None:
    """The parsed scope of the merged latency-specialized kernel serving ``op`` on device type
    ``device`` (:func:`kernel_key`; the very object the dispatcher decides with), or ``None`` if none is
    merged.

    Raises:
        ScopeError, DispatchError: as :func:`_specialized_module`.
    """
    mod = _specialized_module(op, device)
    return None if mod is None else _scope_of(op, mod)


def select(op: str, entry: str, standard: Callable[..., Any], rows: int, device: str, dtype: str,
           shapes: dict[str, int] | None = None) -> Callable[..., Any]:
    """Pick the implementation of ``op`` for one call, record and log the decision.

    Args:
        op: the op name (also the kernel folder under ``k3_model/kernels/``).
        entry: the function name the latency-specialized module must define.
        standard: the standard-path implementation.
        rows: token rows of this call's main input (count). The step's requests and query length come
            from the forward context.
        device: device type of the inputs.
        dtype: dtype name of the op's main input.
        shapes: the call's shape axes (axis -> size); required, with exactly the registered axes, for an
            op that registered a shape domain (:func:`register_op_shapes`).

    Returns:
        The callable to run.

    Raises:
        DispatchError: a merged kernel module is malformed, or the op's call reports other shape axes
            than it registered (a bug in ``k3_model/ops/<op>.py``).
    """
    shapes = dict(shapes or {})
    registered = _OP_SHAPES.get(op)
    if registered is not None and set(shapes) != set(registered):
        raise DispatchError(f"dispatch.select({op!r}): the call reports shape axes {sorted(shapes)} but the op "
                            f"registered {sorted(registered)}; k3_model/ops/{op}.py must pass every registered axis.")
    ctx = _CTX.get()
    if ctx is None:
        impl, reason, fn = STANDARD, "no forward context: step phase unknown", standard
        phase, tp, requests, query_len = "unknown", 1, rows, 1
    else:
        phase, tp = ctx.phase, ctx.tp_size
        requests = rows if ctx.requests is None else ctx.requests
        query_len = ctx.query_len
        if ctx.decode_backend == STANDARD:
            impl, reason, fn = STANDARD, "decode_backend is standard", standard
        else:
            mod = _specialized_module(op, device)
            if mod is None:
                impl, reason, fn = STANDARD, f"no latency-specialized kernel merged for {op}", standard
            else:
                scope = _scope_of(op, mod)
                stand_in = type(mod) is StandardRoutedAsKernel  # in the key: a stand-in may share a kernel's scope
                key = (op, id(scope), stand_in, phase, requests, query_len, rows, device, dtype, tp, tuple(shapes.items()))
                try:
                    hit = _ROUTES.get(key)
                except TypeError:  # an unhashable shape value: route() says what is wrong with it
                    key, hit = None, None
                if hit is not None and hit[0] is scope:
                    impl, reason = hit[1], hit[2]
                else:
                    ok, why = route(op, scope, BatchInfo(phase, requests, query_len, rows, device, dtype, tp, shapes))
                    if ok and stand_in:  # the stand-in's reason is memoized too: both sides pay one lookup a call
                        impl, reason = STANDARD, f"the standard path routed as a kernel ({why})"
                    else:
                        impl, reason = (LATENCY_SPECIALIZED if ok else STANDARD), why
                    if key is not None:
                        if len(_ROUTES) >= _ROUTES_MAX:
                            _ROUTES.clear()
                        _ROUTES[key] = (scope, impl, reason)
                fn = standard if stand_in else getattr(mod, entry, None)
                if not callable(fn):
                    raise DispatchError(
                        f"k3_model.kernels.{kernel_key(op, device)}: entry point {entry!r} is missing or not callable; "
                        f"define def {entry}(...) with the op's signature."
                    )
                if impl == STANDARD:
                    fn = standard
    decision = Decision(op, impl, reason, rows, phase, device, requests, query_len)
    logger.debug("dispatch %s -> %s (%s)", op, impl, reason)
    for trace in _TRACES.get():
        trace.append(decision)
    return fn
