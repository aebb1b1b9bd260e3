"""Task specs: ``tasks/<task_id>/task.toml`` loaded into frozen pydantic models.

A task names one kernel target inside ``k3_model``, the paths a candidate may change, the named axes
and the symbolic shapes of its tensors, the declared scope, the correctness workloads with tolerances
(each with its source), the perf workloads (a subset of the correctness workloads), the thresholds and
the timeouts. Unknown fields are rejected; every error names the file, the field, what was expected
and what was found.

Source: DESIGN.md "Contracts" (Task); TOML because duplicate keys are errors (tomllib).
"""

from __future__ import annotations

import ast
import functools
import re
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from workbench.errors import TaskSpecError

ALWAYS_FORBIDDEN: tuple[str, ...] = (
    "tests/**",
    "tasks/**",
    "guards/**",
    "workbench/**",
    "kernels/**",
    "pyproject.toml",
    ".ci/**",
    "**/conftest.py",
    "conftest.py",
    "**/sitecustomize.py",
    "sitecustomize.py",
    "**/usercustomize.py",
    "usercustomize.py",
    "**/*.pth",
    "*.pth",
    ".gitignore",
    ".gitattributes",
    ".git/**",
)
"""Paths no candidate may change, whatever the task allows (DESIGN.md "Contracts")."""

DTYPES = ("float32", "float16", "bfloat16", "int32", "int64", "bool")
DEVICES = ("cpu", "cuda")
PHASES = ("decode", "prefill", "mixed")

_AXIS_NAME = r"^[A-Z][A-Z0-9_]*$"
_SHAPE_FUNCS = {"cdiv": lambda a, b: -(-a // b), "max": max, "min": min}


Phase = Literal["decode", "spec_verify", "prefill", "mixed"]
"""Step phases, as ``k3_model.dispatch.PHASES``."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _check_expr(expr: str) -> ast.Expression:
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"shape expression {expr!r} is not valid arithmetic ({exc.msg})") from None
    for node in ast.walk(tree):
        ok = isinstance(
            node,
            (ast.Expression, ast.BinOp, ast.Name, ast.Load, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv),
        ) or (isinstance(node, ast.Constant) and type(node.value) is int)
        if isinstance(node, ast.Call):
            ok = isinstance(node.func, ast.Name) and node.func.id in _SHAPE_FUNCS and not node.keywords
        if not ok:
            raise ValueError(
                f"shape expression {expr!r} uses {type(node).__name__}; allowed: axis names, integers, "
                f"+ - * //, and {', '.join(_SHAPE_FUNCS)}(a, b)"
            )
    return tree


def shape_names(expr: str) -> set[str]:
    """Axis names a shape expression refers to (function names excluded)."""
    tree = _check_expr(expr)
    funcs = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - funcs


def eval_dim(expr: str, axes: Mapping[str, int]) -> int:
    """Evaluate one symbolic dimension, e.g. ``"cdiv(T*K + E*(B-1), B)"``, for concrete axes.

    Raises:
        ValueError: the expression is not allowed arithmetic or names an axis missing from ``axes``.
    """

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant):
            return int(node.value)
        if isinstance(node, ast.Name):
            if node.id not in axes:
                raise ValueError(f"shape expression {expr!r} needs axis {node.id!r}; given {sorted(axes)}")
            return int(axes[node.id])
        if isinstance(node, ast.BinOp):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Add):
                return a + b
            if isinstance(node.op, ast.Sub):
                return a - b
            if isinstance(node.op, ast.Mult):
                return a * b
            return a // b
        if isinstance(node, ast.Call):
            return int(_SHAPE_FUNCS[node.func.id](*[ev(a) for a in node.args]))  # type: ignore[union-attr]
        raise ValueError(f"shape expression {expr!r}: unsupported node {type(node).__name__}")

    return ev(_check_expr(expr))


_CMP_OPS = {ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b,
            ast.GtE: lambda a, b: a >= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}
_ARITH_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
              ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b}


def check_constraint(expr: str) -> set[str]:
    """Validate a domain constraint and return the names it uses.

    A constraint is one boolean expression over axis and parameter names: integers, floats, ``True``/
    ``False``, ``+ - * // %``, unary ``-``, comparisons (chains allowed), ``and``/``or``/``not``,
    and ``cdiv``/``max``/``min`` calls, e.g. ``"E % G == 0"``, ``"K <= E // G * TG"``,
    ``"renormalize or G == 1"``. Anything else (attributes, subscripts, other calls, strings) is refused.

    Raises:
        ValueError: the expression is not valid syntax or uses anything outside that form.
    """
    return set(_parsed_constraint(expr)[1])


@functools.lru_cache(maxsize=1024)
def _parsed_constraint(expr: str) -> tuple[ast.Expression, frozenset[str]]:
    """Parse and validate once per expression (see :func:`check_constraint`)."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"constraint {expr!r} is not a valid expression ({exc.msg})") from None
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Name, ast.Load, ast.And,
               ast.Or, ast.Not, ast.USub, *_CMP_OPS, *_ARITH_OPS)
    funcs = set()
    for node in ast.walk(tree):
        ok = isinstance(node, allowed) or (isinstance(node, ast.Constant) and type(node.value) in (int, float, bool))
        if isinstance(node, ast.Call):
            ok = isinstance(node.func, ast.Name) and node.func.id in _SHAPE_FUNCS and not node.keywords
            if ok:
                funcs.add(node.func.id)
        if not ok:
            raise ValueError(
                f"constraint {expr!r} uses {type(node).__name__}; allowed: axis and parameter names, numbers, "
                f"True/False, + - * // %, comparisons, and/or/not, and {', '.join(_SHAPE_FUNCS)}(a, b)"
            )
    return tree, frozenset({n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - funcs)


def eval_constraint(expr: str, values: Mapping[str, Any]) -> bool:
    """Evaluate a domain constraint (see :func:`check_constraint`) for concrete axes and params.

    Args:
        expr: e.g. ``"E % G == 0 and TG <= G"``.
        values: name -> value (ints for axes; bool/int/float for params).

    Returns:
        The truth value (a non-bool result, e.g. ``"E - G"``, is refused).

    Raises:
        ValueError: the expression is not an allowed constraint, names something missing from
            ``values``, divides by zero, or does not evaluate to a bool.
    """
    out = _compiled_constraint(expr)(values)
    if type(out) is not bool:
        raise ValueError(f"constraint {expr!r} evaluates to {out!r}, not True/False; write a comparison")
    return out


@functools.lru_cache(maxsize=1024)
def _compiled_constraint(expr: str) -> Callable[[Mapping[str, Any]], Any]:
    """The parsed constraint as nested closures, built once per expression (the random draws evaluate
    a few constraints hundreds of thousands of times per judgment). Node for node what a tree walk
    does: operands left to right, ``and``/``or`` and comparison chains short-circuit, the same errors
    (a missing name, division by zero) with the same messages; :func:`eval_constraint` checks the type."""
    tree = _parsed_constraint(expr)[0]

    def build(node: ast.AST) -> Callable[[Mapping[str, Any]], Any]:
        if isinstance(node, ast.Expression):
            return build(node.body)
        if isinstance(node, ast.Constant):
            const = node.value
            return lambda values: const
        if isinstance(node, ast.Name):
            name = node.id

            def lookup(values: Mapping[str, Any]) -> Any:
                try:
                    return values[name]
                except KeyError:
                    raise ValueError(f"constraint {expr!r} needs {name!r}; given {sorted(values)}") from None
            return lookup
        if isinstance(node, ast.BinOp):
            left, right, op = build(node.left), build(node.right), _ARITH_OPS[type(node.op)]
            if isinstance(node.op, (ast.FloorDiv, ast.Mod)):
                def divide(values: Mapping[str, Any]) -> Any:
                    a, b = left(values), right(values)
                    if b == 0:
                        raise ValueError(f"constraint {expr!r} divides by zero for {dict(values)}")
                    return op(a, b)
                return divide
            return lambda values: op(left(values), right(values))
        if isinstance(node, ast.UnaryOp):
            operand = build(node.operand)
            if isinstance(node.op, ast.Not):
                return lambda values: not operand(values)
            return lambda values: -operand(values)
        if isinstance(node, ast.BoolOp):
            parts = tuple(build(v) for v in node.values)
            if isinstance(node.op, ast.And):
                def all_of(values: Mapping[str, Any]) -> bool:
                    for part in parts:
                        if not part(values):
                            return False
                    return True
                return all_of

            def any_of(values: Mapping[str, Any]) -> bool:
                for part in parts:
                    if part(values):
                        return True
                return False
            return any_of
        if isinstance(node, ast.Compare):
            first = build(node.left)
            chain = tuple((_CMP_OPS[type(op)], build(comp)) for op, comp in zip(node.ops, node.comparators))

            def compare(values: Mapping[str, Any]) -> bool:
                left = first(values)
                for op, comp in chain:
                    right = comp(values)
                    if not op(left, right):
                        return False
                    left = right
                return True
            return compare
        if isinstance(node, ast.Call):
            func = _SHAPE_FUNCS[node.func.id]  # type: ignore[union-attr]
            args = tuple(build(a) for a in node.args)
            return lambda values: func(*[a(values) for a in args])
        raise ValueError(f"constraint {expr!r}: unsupported node {type(node).__name__}")

    return build(tree)


class AxisSpec(_Frozen):
    """One named axis (a tensor dimension or a size the op takes), e.g. ``T`` decode tokens."""

    description: str = Field(min_length=1)


class TensorSpec(_Frozen):
    """A tensor argument of the op.

    Attributes:
        shape: symbolic dims, each an axis expression (``"T"``, ``"T*K + E*(B-1)"``).
        dtype: one of float32, float16, bfloat16, int32, int64, bool.
        description: meaning, layout and units.
        poison: outputs only: the value every element is set to before the call, so an element the
            candidate never writes is caught. Defaults to NaN for floats and -7777 for integers.
        inplace: outputs only: the op writes this output into the input of the same name (vLLM's
            in-place ``fused_add_rms_norm`` contract); no separate buffer is passed, the input is
            allowed to change and is read back after the call as the output.
        per_rank: inputs of distributed tasks only: every TP rank gets its own tensor of this shape;
            ``inputs.make_inputs`` returns them stacked along a leading world-size dimension.
    """

    shape: tuple[str, ...]
    dtype: Literal["float32", "float16", "bfloat16", "int32", "int64", "bool"]
    description: str = Field(min_length=1)
    poison: float | int | None = None
    inplace: bool = False
    per_rank: bool = False

    @field_validator("shape")
    @classmethod
    def _shape_ok(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for dim in v:
            _check_expr(dim)
        return v


class ToleranceSpec(_Frozen):
    """How one output is compared with the reference.

    Attributes:
        rtol: relative tolerance (dimensionless).
        atol: absolute tolerance (in the output's units).
        exact: compare bit-exactly (integers, ids).
        source: where the numbers come from (a section of shared/reference or a paper); required.
    """

    rtol: float = Field(default=0.0, ge=0.0)
    atol: float = Field(default=0.0, ge=0.0)
    exact: bool = False
    source: str = Field(min_length=3)


class WorkloadSpec(_Frozen):
    """One concrete configuration of the op.

    Attributes:
        name: unique id within the task (used by perf workloads and result files).
        axes: a value for every axis of the task.
        params: scalar keyword arguments of the op (bools, floats, ints, strings).
        case: the input distribution ``inputs.make_inputs`` draws (``"realistic"`` or an edge case).
        phase: the step phase the dispatcher is told (``decode``, ``spec_verify``, ``prefill``, ``mixed``);
            unset: the first of the task's ``scope.phases``.
        random_template: random correctness draws may start from this workload and redraw the batch axis.
        invariance: a checked ``[domain.invariances]`` entry (a metamorphic pair): the second call's
            inputs are the transformed twin of the first's, and the outputs are related
            (:class:`DomainInvarianceSpec`); ``""``: an independent second draw. Random draws get one
            at run time (``guards.cases.random_workloads``).
    """

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_\-]*$")
    axes: dict[str, int]
    params: dict[str, bool | int | float | str] = Field(default_factory=dict)
    case: str = "realistic"
    phase: Phase = "decode"
    random_template: bool = False
    invariance: str = ""
    note: str = ""


class ScopeSpec(_Frozen):
    """Where a latency-specialized implementation may claim to run (DESIGN.md "K3 ops"), in requests and
    query tokens per request, as a kernel's ``SCOPE`` (``k3_model.dispatch.OpScope``; issue 21,
    docs/scope-requests.md).

    Attributes:
        devices: device kinds (``cpu``, ``cuda``).
        phases: step phases (``decode``: one query token per request; ``spec_verify``: 1 + D).
        tp_sizes: tensor-parallel world sizes.
        dtypes: dtypes of ``dtype_input``.
        dtype_input: the input whose dtype is the op's dtype.
        requests_axis: the axis that counts the step's requests when the op's main input has one row per
            request (dspark_verify ``B``; a decode-only task's row axis: on a decode step each request is
            one token row). Exactly one of ``requests_axis`` and ``rows_axis``.
        rows_axis: the axis of the op's token rows when a request brings 1 + D of them (moe_dispatch
            ``T``); needs ``draft_axis`` or ``query_len_axis``. A case's requests are then
            ``ceil(rows / query length)``: the fewest
            requests whose query tokens hold the rows (ragged drafts give fewer rows than requests x
            query length, as vLLM and K3-mini's speculative mode make them).
        requests_min, requests_max: inclusive range of requests (count).
        draft_axis: the axis that counts draft tokens per request (D >= 1; query length 1 + D), or unset
            for a task judged on decode steps only (query length 1).
        query_len_axis: instead of ``draft_axis``, an axis whose value is the query length itself (axes are
            sizes >= 1, so a task that mixes decode steps, query length 1, with verification steps names
            this one: moe_dispatch ``Q``). With either, query length 1 is a decode step and above 1 a
            verification step.
        query_len_min, query_len_max: inclusive range of query tokens per request (count).

    Raises:
        ValueError (pydantic): an empty range, the old row fields ``batch_axis``/``batch_min``/``batch_max``
            (with their replacements named), query length above 1 without a draft axis, or phases that
            disagree with the query length.
    """

    devices: tuple[Literal["cpu", "cuda"], ...]
    phases: tuple[Phase, ...] = ("decode",)
    tp_sizes: tuple[int, ...] = (1,)
    dtypes: tuple[Literal["float32", "float16", "bfloat16"], ...]
    dtype_input: str
    requests_axis: str | None = None
    rows_axis: str | None = None
    requests_min: int = Field(ge=1)
    requests_max: int = Field(ge=1)
    draft_axis: str | None = None
    query_len_axis: str | None = None
    query_len_min: int = Field(default=1, ge=1)
    query_len_max: int = Field(default=1, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _old_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            old = [k for k in ("batch_axis", "batch_min", "batch_max") if k in data]
            if old:
                raise ValueError(f"[scope] names {', '.join(old)}, the token-row fields of before issue 21; declare "
                                 "requests_axis, requests_min, requests_max (requests in the step) and, for a task "
                                 "judged on verification steps, draft_axis, query_len_min, query_len_max (1 + D query "
                                 "tokens per request). See docs/scope-requests.md")
        return data

    @model_validator(mode="after")
    def _range(self) -> ScopeSpec:
        if (self.requests_axis is None) == (self.rows_axis is None):
            raise ValueError("declare exactly one of requests_axis (one row per request) and rows_axis (1 + D rows per "
                             f"request, with draft_axis); got requests_axis={self.requests_axis!r}, "
                             f"rows_axis={self.rows_axis!r}")
        if self.draft_axis is not None and self.query_len_axis is not None:
            raise ValueError(f"declare draft_axis ({self.draft_axis!r}, query length 1 + D) or query_len_axis "
                             f"({self.query_len_axis!r}, the query length itself), not both")
        if self.rows_axis is not None and self.query_axis is None:
            raise ValueError(f"rows_axis {self.rows_axis!r} needs a draft_axis or query_len_axis (a request brings 1 + D "
                             "rows)")
        if self.requests_max < self.requests_min:
            raise ValueError(f"requests_max ({self.requests_max}) is below requests_min ({self.requests_min})")
        if self.query_len_max < self.query_len_min:
            raise ValueError(f"query_len_max ({self.query_len_max}) is below query_len_min ({self.query_len_min})")
        if self.query_axis is None and self.query_len_max > 1:
            raise ValueError(f"query_len_max {self.query_len_max} needs a draft_axis (the axis of D, query length 1 + D) "
                             "or a query_len_axis")
        if (self.query_len_max > 1) != ("spec_verify" in self.phases):
            raise ValueError(f"phases {list(self.phases)} and query length [{self.query_len_min}, {self.query_len_max}] "
                             "disagree: list \"spec_verify\" exactly when query_len_max is above 1")
        if ("decode" in self.phases) != (self.query_len_min == 1):
            raise ValueError(f"phases {list(self.phases)} and query_len_min {self.query_len_min} disagree: list \"decode\" "
                             "exactly when query_len_min is 1 (a decode step has one query token per request)")
        return self

    @property
    def query_axis(self) -> tuple[str, int] | None:
        """(the axis that gives the query length, what to add to its value): ``(draft_axis, 1)``,
        ``(query_len_axis, 0)``, or ``None`` for a decode-only task."""
        if self.draft_axis is not None:
            return self.draft_axis, 1
        if self.query_len_axis is not None:
            return self.query_len_axis, 0
        return None

    def query_len(self, axes: Mapping[str, int]) -> int:
        """Query tokens per request of a case with these axis values (count)."""
        qa = self.query_axis
        return 1 if qa is None else int(axes[qa[0]]) + qa[1]

    @property
    def batch_axis(self) -> str:
        """The axis a batch sweep or a redraw of the batch changes: ``requests_axis`` or ``rows_axis``."""
        return self.requests_axis or self.rows_axis  # type: ignore[return-value]

    def batch_range(self, axes: Mapping[str, int]) -> tuple[int, int]:
        """Inclusive range of :attr:`batch_axis` whose steps stay in scope with the other ``axes`` kept:
        ``[requests_min, requests_max]``, or for a rows axis ``[1, requests_max x (1 + D)]``."""
        if self.requests_axis is not None:
            return self.requests_min, self.requests_max
        return 1, self.requests_max * self.query_len(axes)

    def step(self, axes: Mapping[str, int], phase: str | None = None) -> tuple[str, int, int, int]:
        """(phase, requests, query length, token rows) of a case with these axis values: what the guards'
        child gives ``k3_model.dispatch.forward_context`` and the activation guard checks claims with.

        Args:
            axes: the case's axis values (every axis of the task).
            phase: the workload's phase; used when the task has no draft axis. With one the phase
                follows the query length: ``decode`` at 1, ``spec_verify`` above.

        Raises:
            KeyError: ``axes`` lacks the requests, rows or draft axis (a workload names every axis).
        """
        query_len = self.query_len(axes)
        if self.requests_axis is not None:
            requests = rows = int(axes[self.requests_axis])
        else:
            rows = int(axes[self.rows_axis])  # type: ignore[index]
            requests = -(-rows // query_len)
        if self.query_axis is not None:
            phase = "spec_verify" if query_len > 1 else "decode"
        return phase or self.phases[0], requests, query_len, rows

    def claim_dict(self) -> dict[str, Any]:
        """The task's scope as the judged limits a kernel's ``SCOPE`` is held to (plain lists and ints: the
        form the guards' child compares a declared scope with)."""
        return {"devices": list(self.devices), "phases": list(self.phases), "tp_sizes": list(self.tp_sizes),
                "dtypes": list(self.dtypes), "requests_min": self.requests_min, "requests_max": self.requests_max,
                "query_len_min": self.query_len_min, "query_len_max": self.query_len_max}


Scalar = bool | int | float | str


class DomainValueSpec(_Frozen):
    """The legal values of one axis or op parameter, and the model's realistic ones.

    Exactly one form: ``choices`` (a finite list, simplest first: the shrinker moves toward the
    first) or ``min``/``max`` (an inclusive range; integers for axes and int params). A range is
    drawn at its edges, at its ``realistic`` values and inside it (log-uniformly when ``log``).

    Attributes:
        choices: the legal values (bools, ints, floats or strings), listed simplest first.
        min, max: inclusive legal range.
        log: draw the inside of a range log-uniformly (needs ``min > 0``).
        realistic: the values the model uses (each must be legal); drawn as cells of their own.
        source: where the legal range and the realistic values come from (required).
        note: anything a reader needs (what lies outside and why).
    """

    choices: tuple[Scalar, ...] | None = None
    min: int | float | None = None
    max: int | float | None = None
    log: bool = False
    realistic: tuple[Scalar, ...] = ()
    source: str = Field(min_length=3)
    note: str = ""

    @model_validator(mode="after")
    def _form(self) -> DomainValueSpec:
        has_range = self.min is not None or self.max is not None
        if (self.choices is None) == (not has_range):
            raise ValueError("give either 'choices' or both 'min' and 'max' (exactly one form)")
        if self.choices is not None:
            if not self.choices:
                raise ValueError("'choices' is empty; list at least one legal value")
            if len(set(map(repr, self.choices))) != len(self.choices):
                raise ValueError(f"'choices' {list(self.choices)} lists a value twice")
            if self.log:
                raise ValueError("'log' applies to a min/max range, not to choices")
            for r in self.realistic:
                if not any(r == c and type(r) is type(c) for c in self.choices):
                    raise ValueError(f"realistic value {r!r} is not among the choices {list(self.choices)}")
            return self
        if self.min is None or self.max is None:
            raise ValueError("a range needs both 'min' and 'max'")
        if type(self.min) is bool or type(self.max) is bool:
            raise ValueError("'min'/'max' must be numbers, not booleans (use choices = [true, false])")
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        if self.log and not self.min > 0:
            raise ValueError(f"'log' needs min > 0; got min = {self.min}")
        for r in self.realistic:
            if type(r) is bool or not isinstance(r, (int, float)) or not self.min <= r <= self.max:
                raise ValueError(f"realistic value {r!r} lies outside [min, max] = [{self.min}, {self.max}]")
        return self

    @property
    def is_int_range(self) -> bool:
        """A range whose ends are both integers (drawn as integers)."""
        return self.choices is None and type(self.min) is int and type(self.max) is int

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is legal here (same type as the choices; inside the range)."""
        if self.choices is not None:
            return any(value == c and type(value) is type(c) for c in self.choices)
        if type(value) is bool or not isinstance(value, (int, float)):
            return False
        if self.is_int_range and type(value) is not int:
            return False
        return self.min <= value <= self.max  # type: ignore[operator]


class DomainRegimeSpec(_Frozen):
    """One input regime random draws may use: a ``case`` that ``inputs.make_inputs`` supports.

    Attributes:
        source: why this regime is legal and worth drawing (a bug report, the contract, an issue).
        note: what the regime draws.
        requires: a constraint (see :func:`check_constraint`) the axes and params of a draw must meet
            for this regime, e.g. ``"T >= 2"``; empty = any draw.
        realistic: the regime is the model's realistic range (the shrinker's target), not an edge.
        timed: serving steps carry this regime (e.g. CUDA-graph padding rows on every padded decode
            step), so the perf guard's run-time domain draws time it too, for regressions; realistic
            regimes are always timed, edge cases (ties, denormals) never: a slower path there is legal.
    """

    source: str = Field(min_length=3)
    note: str = ""
    requires: str = ""
    realistic: bool = False
    timed: bool = False

    @field_validator("requires")
    @classmethod
    def _requires_ok(cls, v: str) -> str:
        if v:
            check_constraint(v)
        return v


class DomainOverlaySpec(_Frozen):
    """A change a task's ``inputs.py`` can make on top of any regime's draw (e.g. CUDA-graph padding rows).

    A regime decides how the valid data is distributed; an overlay changes a draw whatever its regime.
    Random draws count each overlay as a coverage dimension of its own (cells: off, on), so pairwise
    coverage crosses it with every regime and every axis value (:func:`guards.cases.domain_draws`): as a
    regime it met only the realistic data (session 13's red team: a kernel wrong only when padding rows
    meet a wide or shifted bias was accepted, since no draw held both). A workload names its overlays
    after its regime: ``case = "wide_bias+padding_rows"`` (:meth:`DomainSpec.split_case`).

    Attributes:
        apply: the ``inputs.py`` function ``(inputs, axes, seed) -> inputs`` that makes the change (it
            may change the tensors in place; names, shapes and dtypes stay).
        source: why the overlay is legal and worth drawing.
        note: what it changes.
        requires: a constraint the axes and params must meet for the overlay (``"T >= 2"``); empty = any.
        timed: serving steps carry it (padding rows on every padded CUDA-graph step), so perf's domain
            draws time it too.
        layout: the overlay changes the memory layout of the inputs within what the contract allows (e.g.
            x as a row view of a wider buffer, row stride > K), not their values: the harness keeps the
            tensors' strides (:func:`guards.cases.make_case_inputs`, the child's copies); other draws are
            packed (contiguous).
        variants: kinds of the change (e.g. how many rows are padding: one, a few, many); each is a cell
            of the overlay's coverage dimension, so every kind meets every regime and value (session 14's
            red team: a kernel wrong only with 2 to T/4 - 1 padding rows was accepted while the count was
            a random choice inside the overlay). The case names one as ``padding_rows:few`` and ``apply``
            gets it as ``variant=``; empty: the overlay is on or off.
    """

    apply: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    variants: tuple[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")], ...] = ()
    source: str = Field(min_length=3)
    note: str = ""
    requires: str = ""
    timed: bool = False
    layout: bool = False

    @field_validator("requires")
    @classmethod
    def _requires_ok(cls, v: str) -> str:
        if v:
            check_constraint(v)
        return v


class DomainInputSpec(_Frozen):
    """The value range of one input tensor.

    Attributes:
        realistic: the model's realistic range (what K3 feeds the op), in words with numbers.
        legal: the op's legal range (what the contract accepts), in words with numbers.
        cases: the regimes (keys of ``[domain.regimes]``) that draw this input from its range.
        source: where the ranges come from.
    """

    realistic: str = Field(min_length=3)
    legal: str = Field(min_length=3)
    cases: tuple[str, ...] = Field(min_length=1)
    source: str = Field(min_length=3)


_PY_NAME = r"^[a-z_][a-z0-9_]*$"


class DomainInvarianceSpec(_Frozen):
    """A transformation of the inputs under which the outputs change in a known way (unchanged, or
    permuted), e.g. a constant bias shift leaving the MoE selection unchanged.

    With ``transform`` and ``relation`` it is a **metamorphic pair** checked in every correctness
    verdict: random draws it applies to get the transformed twin of their first input draw as their
    second call's inputs (``guards.cases.build_case``), and the correctness guard checks the
    candidate's outputs on the twin against its own outputs on the original through ``relation``
    (besides the reference on both). Without them it is declared only (drawn by its ``regime``).

    Attributes:
        description: what the transformation does and what it leaves unchanged.
        regime: the regime that draws inputs near this invariance (``""``: none).
        transform: name of a function in the task's ``inputs.py``,
            ``transform(inputs, axes, params, seed) -> (twin_inputs, info)``: the twin (same names,
            shapes and dtypes) and ``info``, plain data (lists, numbers) the relation needs.
        relation: name of a function in the task's ``reference.py``, ``relation(inputs, outputs,
            twin_inputs, twin_outputs, info, params, tolerance) -> list[str]``: one line per broken
            expectation (output, index, expected, seen); empty when the pair is consistent.
        requires: a constraint on a draw's axes and params for the pair to apply (e.g. ``"T >= 2"``:
            a permutation of one token is the identity); empty = every draw.
        regimes: the regimes whose draws may get the pair; empty = every regime.
        source: why the outputs must relate so (the contract, a reference section).
    """

    description: str = Field(min_length=10)
    regime: str = ""
    transform: Annotated[str, Field(pattern=_PY_NAME)] | None = None
    relation: Annotated[str, Field(pattern=_PY_NAME)] | None = None
    requires: str = ""
    regimes: tuple[str, ...] = ()
    source: str = Field(min_length=3)

    @model_validator(mode="after")
    def _pair(self) -> DomainInvarianceSpec:
        if (self.transform is None) != (self.relation is None):
            have, lack = ("transform", "relation") if self.relation is None else ("relation", "transform")
            raise ValueError(f"'{have}' is set but '{lack}' is not; a metamorphic pair needs both (the function "
                             "that makes the twin in inputs.py and the one that relates the outputs in reference.py)")
        if (self.requires or self.regimes) and self.transform is None:
            raise ValueError("'requires'/'regimes' restrict a metamorphic pair, but no 'transform' is set")
        if self.requires:
            check_constraint(self.requires)
        return self

    @property
    def checked(self) -> bool:
        """Whether the invariance is checked as a metamorphic pair (it has a transform and a relation)."""
        return self.transform is not None


class DomainFeatureSpec(_Frozen):
    """A derived condition of a configuration that coverage counts as a dimension of its own.

    Random draws cover pairs of cells (:func:`guards.cases.domain_draws`). A condition no single axis
    holds (expert groups dropped: ``TG < G``) is paired with the regimes and the axis values only by
    luck unless it is a dimension; declared here, it has two cells (holds, does not hold) and every
    pair it makes with a regime or a value is targeted like any other.

    Attributes:
        expr: a boolean expression over axis and parameter names (the :func:`check_constraint` form).
        source: why the condition matters (the bug class or contract clause it separates).
    """

    expr: str
    source: str = Field(min_length=10)

    @model_validator(mode="after")
    def _valid(self) -> DomainFeatureSpec:
        check_constraint(self.expr)
        return self


class DomainSpec(_Frozen):
    """The op's declared input domain: what random correctness draws explore (issue 12 item 5,
    issue 19 item 1).

    Attributes:
        axes: legal (and realistic) values of every axis of the task.
        params: legal values of every op parameter the workloads set.
        constraints: relations the op's contract requires between axes and params (each a boolean
            expression, :func:`check_constraint`), e.g. ``"E % G == 0"``.
        cost_constraints: limits on random draws that keep a verdict within its time and memory;
            they are not the op's legality (fixed workloads may lie outside them).
        cost_source: why the cost constraints are what they are (required with them).
        cost_ceiling: the largest configurations a judge can still afford (constraints in the same form);
            required with ``cost_constraints``. Each run adds ``beyond_cost_draws`` configurations that
            break a cost constraint but stay under the ceiling (:func:`guards.cases.beyond_cost_draws`),
            so a kernel wrong only above the cost cap (session 14's red team: rows of a blocked path
            above 2^23 elements left unwritten, while every draw stayed <= 2^22) is judged there too.
        beyond_cost_draws: how many (0 turns them off; a task whose cost constraints admit every
            legal configuration gets none, there being none to draw).
        regimes: input regimes (``make_inputs`` cases) random draws use; one must be ``realistic``.
        inputs: the realistic and legal range of every input tensor and the regimes that draw it.
        invariances: transformations with a known effect on the outputs; those with a transform and a
            relation are checked as metamorphic pairs (:class:`DomainInvarianceSpec`).
        features: derived conditions that coverage pairs with every regime and value
            (:class:`DomainFeatureSpec`).
        overlays: changes applied on top of any regime's draw, each a coverage dimension of its own
            (:class:`DomainOverlaySpec`).
        note: anything else a reader of the domain needs.
    """

    axes: dict[str, DomainValueSpec]
    params: dict[str, DomainValueSpec] = Field(default_factory=dict)
    constraints: tuple[str, ...] = ()
    cost_constraints: tuple[str, ...] = ()
    cost_source: str = ""
    cost_ceiling: tuple[str, ...] = ()
    beyond_cost_draws: int = Field(default=2, ge=0, le=8)
    regimes: dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")], DomainRegimeSpec] = Field(min_length=1)
    inputs: dict[str, DomainInputSpec]
    invariances: dict[str, DomainInvarianceSpec] = Field(default_factory=dict)
    features: dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")], DomainFeatureSpec] = Field(default_factory=dict)
    overlays: dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")], DomainOverlaySpec] = Field(default_factory=dict)
    note: str = ""

    @model_validator(mode="after")
    def _self_consistent(self) -> DomainSpec:
        for fname, feat in self.features.items():
            unknown = sorted(check_constraint(feat.expr) - set(self.axes) - set(self.params))
            if unknown:
                raise ValueError(f"features.{fname}: {feat.expr!r} names {unknown}, which are neither axes nor params "
                                 f"of the domain (axes: {', '.join(self.axes)}; params: {', '.join(self.params) or 'none'})")
        for kind in ("constraints", "cost_constraints", "cost_ceiling"):
            for c in getattr(self, kind):
                check_constraint(c)
        if self.cost_constraints and len(self.cost_source) < 10:
            raise ValueError("cost_constraints are set but cost_source does not say why; give the measured cost")
        if self.cost_constraints and not self.cost_ceiling:
            raise ValueError("cost_constraints are set but cost_ceiling is not: declare the largest configurations a "
                             "judge can afford (e.g. cost_ceiling = [\"N * B <= 16777216\"]); run-time draws beyond the cost "
                             "constraints go up to it, so no legal size the model serves is left unjudged")
        if "realistic" not in self.regimes:
            raise ValueError(f"regimes {sorted(self.regimes)} lack 'realistic' (the model's own range)")
        both = sorted(set(self.regimes) & set(self.overlays))
        if both:
            raise ValueError(f"{both[0]!r} is both a regime and an overlay; a case names each once (rename one)")
        for name, inp in self.inputs.items():
            for c in inp.cases:
                if c not in self.regimes and c not in self.overlays:
                    raise ValueError(f"inputs.{name}.cases names regime {c!r}, which is not in [domain.regimes] "
                                     f"(known: {', '.join(sorted(self.regimes))}) nor in [domain.overlays] "
                                     f"(known: {', '.join(sorted(self.overlays)) or 'none'})")
        named = {c for inp in self.inputs.values() for c in inp.cases}
        orphans = sorted((set(self.regimes) | set(self.overlays)) - named)
        if orphans:
            raise ValueError(f"regime or overlay {orphans[0]!r} is named by no input's 'cases'; say which input it draws")
        for name, inv in self.invariances.items():
            if inv.regime and inv.regime not in self.regimes:
                raise ValueError(f"invariances.{name}.regime {inv.regime!r} is not in [domain.regimes]")
            for r in inv.regimes:
                if r not in self.regimes:
                    raise ValueError(f"invariances.{name}.regimes names {r!r}, which is not in [domain.regimes] "
                                     f"(known: {', '.join(sorted(self.regimes))})")
        for name, spec in self.axes.items():
            if spec.choices is not None and any(type(c) is not int for c in spec.choices):
                raise ValueError(f"axes.{name}.choices must be integers; got {list(spec.choices)}")
            if spec.choices is None and not spec.is_int_range:
                raise ValueError(f"axes.{name}: min and max must be integers; got [{spec.min}, {spec.max}]")
            lo = min(spec.choices) if spec.choices is not None else spec.min
            if lo < 1:  # type: ignore[operator]
                raise ValueError(f"axes.{name}: axis values must be >= 1; the domain allows {lo}")
        return self

    @staticmethod
    def regime_of(case: str) -> str:
        """The regime part of a case string: ``"wide_bias+padding_rows:few"`` -> ``"wide_bias"``."""
        return case.split("+")[0]

    @staticmethod
    def overlay_of(part: str) -> tuple[str, str]:
        """An overlay part of a case string as ``(overlay, variant)``: ``"padding_rows:few"`` ->
        ``("padding_rows", "few")``; ``""`` for the variant when the part names none."""
        name, _, variant = part.partition(":")
        return name, variant

    def split_case(self, case: str) -> tuple[str, tuple[str, ...]]:
        """A workload's ``case`` as its regime and its overlays: ``"wide_bias+padding_rows"`` ->
        ``("wide_bias", ("padding_rows",))``; a plain case has no overlays.

        Raises:
            ValueError: a ``+`` part is not in ``[domain.overlays]``, or is named twice.
        """
        regime, *overlays = case.split("+")
        names = [self.overlay_of(o)[0] for o in overlays]
        for o, name in zip(overlays, names):
            if name not in self.overlays:
                raise ValueError(f"case {case!r} names overlay {name!r}, which is not in [domain.overlays] "
                                 f"(known: {', '.join(sorted(self.overlays)) or 'none'}); write '<regime>+<overlay>'")
            variant = self.overlay_of(o)[1]
            if ":" in o and variant not in self.overlays[name].variants:
                raise ValueError(f"case {case!r} names variant {variant!r} of overlay {name!r}; its variants: "
                                 f"{', '.join(self.overlays[name].variants) or 'none'}")
        if len(set(names)) != len(names):
            raise ValueError(f"case {case!r} names an overlay twice")
        return regime, tuple(overlays)

    def names(self) -> set[str]:
        """Every axis and parameter name (what constraints may refer to)."""
        return set(self.axes) | set(self.params)

    def satisfied(self, values: Mapping[str, Any], cost: bool = True) -> bool:
        """Whether ``values`` (axes and params) meets every constraint (and every cost constraint)."""
        exprs = self.constraints + (self.cost_constraints if cost else ())
        return all(eval_constraint(c, values) for c in exprs)


class CorrectnessSpec(_Frozen):
    """Correctness checks: fixed workloads plus random draws inside the scope.

    Attributes:
        workloads: the fixed workloads (real K3 sizes, K3-mini sizes, edge cases).
        random_draws: how many extra workloads are drawn at run time from ``random_template``
            workloads with the batch axis redrawn inside the scope (seed chosen at run time).
        public_seeds: seeds an agent may use to self-check; run-time seeds are never among them.
        tolerance: per output name.
    """

    workloads: tuple[WorkloadSpec, ...] = Field(min_length=1)
    random_draws: int = Field(default=8, ge=0, le=256)
    public_seeds: tuple[int, ...] = (0, 1, 2)
    tolerance: dict[str, ToleranceSpec]


class PerfDeviceSpec(_Frozen):
    """Regression-test settings for one device kind, calibrated there (overrides ``PerfSpec``'s).

    Attributes:
        max_regression_pct: tolerated slowdown (percent of the baseline median).
        alpha: significance level of the regression test (0-1).
        source: the calibration result file that justifies them.
    """

    max_regression_pct: float = Field(gt=0, le=100)
    alpha: float = Field(gt=0.0, lt=0.5)
    source: str = Field(min_length=3)


class PerfSpec(_Frozen):
    """Performance checks.

    Attributes:
        workloads: names of correctness workloads that are also timed.
        max_regression_pct: largest tolerated slowdown of the candidate vs the baseline at any
            configuration (percent of the baseline median).
        min_speedup: speedup (baseline median / candidate median) required where the candidate
            claims its path runs.
        warmup: untimed calls per implementation before timing.
        repetitions: timed calls per implementation (interleaved A B A B).
        confidence: two-sided confidence level of the bootstrap interval (0-1).
        alpha: significance level of the regression test (0-1).
        source: where the thresholds come from.
        cuda: settings calibrated on a GPU (A/A false alarms, planted-slowdown power), used instead
            of ``max_regression_pct`` and ``alpha`` when the guard runs on CUDA.
        devices: devices on which performance is judged (default both); elsewhere the perf guard SKIPs
            and says why (``devices_reason``).
        devices_reason: why performance is not judged on the other devices (required when ``devices``
            leaves one out).
    """

    workloads: tuple[str, ...] = Field(min_length=1)
    max_regression_pct: float = Field(gt=0, le=100)
    min_speedup: float = Field(ge=1.0)
    warmup: int = Field(default=10, ge=0)
    repetitions: int = Field(default=100, ge=10)
    confidence: float = Field(default=0.99, gt=0.5, lt=1.0)
    alpha: float = Field(default=0.01, gt=0.0, lt=0.5)
    source: str = Field(min_length=3)
    cuda: PerfDeviceSpec | None = None
    devices: tuple[Literal["cpu", "cuda"], ...] = ("cpu", "cuda")
    devices_reason: str = ""

    @model_validator(mode="after")
    def _devices_reason(self) -> PerfSpec:
        if set(self.devices) != {"cpu", "cuda"} and len(self.devices_reason) < 10:
            raise ValueError(f"perf.devices {list(self.devices)} leaves a device out; say why in perf.devices_reason")
        return self

    def regression_test(self, device: str) -> tuple[float, float]:
        """``(max_regression_pct, alpha)`` for ``device`` (the calibrated CUDA pair where given)."""
        if device == "cuda" and self.cuda is not None:
            return self.cuda.max_regression_pct, self.cuda.alpha
        return self.max_regression_pct, self.alpha


class DistributedSpec(_Frozen):
    """A task whose op runs on every rank of a tensor-parallel group (one process per rank).

    Attributes:
        world_size_axis: the workload axis that gives the world size (TP size) of each case.
        backend_cpu: ``torch.distributed`` backend of CPU runs (gloo).
        backend_cuda: backend of CUDA runs (NCCL; one GPU per rank, NVLink multicast off).
        identical_across_ranks: outputs every rank must hold bit for bit (bitwise-identical results
            on all ranks: kernel_targets.md §1.5).
        collective_timeout_s: a rank waiting longer than this in a collective fails instead of
            hanging (seconds).
    """

    world_size_axis: str
    backend_cpu: Literal["gloo"] = "gloo"
    backend_cuda: Literal["nccl"] = "nccl"
    identical_across_ranks: tuple[str, ...] = ()
    collective_timeout_s: float = Field(default=60.0, gt=0)


class TimeoutSpec(_Frozen):
    """Wall-clock limits for the child processes (seconds) and their address-space cap (bytes)."""

    correctness_s: float = Field(default=300, gt=0)
    perf_s: float = Field(default=300, gt=0)
    memory_bytes: int = Field(default=8 * 2**30, gt=0)


class TaskSpec(_Frozen):
    """A whole task (``tasks/<task_id>/task.toml``).

    Attributes:
        task_id: the folder name (not written in the file).
        root: the task folder (set by the loader).
        op: the model op's name as the dispatcher knows it.
        target: ``module:function`` inside ``k3_model`` the candidate implements (via the dispatcher).
        description: one paragraph for the agent and the reviewer.
        allowed_paths: globs (``**`` spans folders) a candidate may change.
        axes: named axes.
        axis_params: op keyword arguments whose values are axis values (``top_k = "K"``).
        inputs, outputs: tensor arguments (outputs are preallocated by the caller and poisoned).
        scope, correctness, perf, timeouts: see their classes.
    """

    task_id: str
    root: Path
    op: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    target: str = Field(pattern=r"^k3_model(\.[a-z_][a-z0-9_]*)+:[a-z_][a-z0-9_]*$")
    description: str = Field(min_length=10)
    allowed_paths: tuple[str, ...] = Field(min_length=1)
    axes: dict[Annotated[str, Field(pattern=_AXIS_NAME)], AxisSpec]
    axis_params: dict[str, str] = Field(default_factory=dict)
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]
    scope: ScopeSpec
    correctness: CorrectnessSpec
    perf: PerfSpec
    timeouts: TimeoutSpec = TimeoutSpec()
    distributed: DistributedSpec | None = None
    domain: DomainSpec | None = None

    @model_validator(mode="before")
    @classmethod
    def _default_phase(cls, data: Any) -> Any:
        """A workload that names no phase runs in the first of the scope's phases (``spec_verify`` for a task
        judged on verification steps only); in a task with a query-length axis, in the phase its query length
        makes (``decode`` at 1, ``spec_verify`` above)."""
        if not isinstance(data, dict):
            return data
        scope, corr = data.get("scope"), data.get("correctness")
        phases = scope.get("phases") if isinstance(scope, dict) else None
        if not phases or not isinstance(phases, list | tuple) or not isinstance(corr, dict):
            return data
        wls = corr.get("workloads")
        if not isinstance(wls, list):
            return data
        qa = [(scope.get(k), off) for k, off in (("draft_axis", 1), ("query_len_axis", 0)) if scope.get(k)]

        def phase_of(w: dict) -> Any:
            axes = w.get("axes")
            if qa and isinstance(axes, dict) and isinstance(axes.get(qa[0][0]), int):
                return "spec_verify" if axes[qa[0][0]] + qa[0][1] > 1 else "decode"
            return phases[0]
        filled = [({**w, "phase": phase_of(w)} if isinstance(w, dict) and "phase" not in w else w) for w in wls]
        return {**data, "correctness": {**corr, "workloads": filled}}

    @model_validator(mode="after")
    def _consistent(self) -> TaskSpec:
        axes = set(self.axes)
        for name, t in self.inputs.items():
            if t.inplace:
                raise ValueError(f"inputs.{name}: 'inplace' applies to outputs only (name the output after the input)")
            if t.per_rank and self.distributed is None:
                raise ValueError(f"inputs.{name}: per_rank needs a [distributed] table (world_size_axis)")
        for name, t in self.outputs.items():
            if t.per_rank:
                raise ValueError(f"outputs.{name}: 'per_rank' applies to inputs only")
            if t.inplace:
                src = self.inputs.get(name)
                if src is None or src.shape != t.shape or src.dtype != t.dtype:
                    raise ValueError(
                        f"outputs.{name} is inplace but no input {name!r} of shape {list(t.shape)} and dtype "
                        f"{t.dtype} exists; an in-place output must name the input it overwrites"
                    )
        if self.distributed is not None:
            d = self.distributed
            if d.world_size_axis not in axes:
                raise ValueError(f"distributed.world_size_axis {d.world_size_axis!r} is not in [axes]")
            for o in d.identical_across_ranks:
                if o not in self.outputs:
                    raise ValueError(f"distributed.identical_across_ranks names {o!r}, which is not an output")
            for w in self.correctness.workloads:
                ws = w.axes.get(d.world_size_axis)
                if ws is not None and ws not in self.scope.tp_sizes:
                    raise ValueError(
                        f"correctness workload {w.name!r}: world size {d.world_size_axis} = {ws} is outside "
                        f"scope.tp_sizes {list(self.scope.tp_sizes)}"
                    )
        for kind, tensors in (("inputs", self.inputs), ("outputs", self.outputs)):
            for name, t in tensors.items():
                for dim in t.shape:
                    missing = shape_names(dim) - axes
                    if missing:
                        raise ValueError(
                            f"{kind}.{name}.shape uses undefined axis {sorted(missing)[0]!r}; "
                            f"defined axes: {', '.join(sorted(axes))}. Add it to [axes] or fix the shape"
                        )
        for kw, ax in self.axis_params.items():
            if ax not in axes:
                raise ValueError(f"axis_params.{kw} names axis {ax!r}, which is not in [axes]")
        for pattern in self.allowed_paths:
            if pattern.startswith("/") or ".." in pattern.split("/"):
                raise ValueError(f"allowed_paths entry {pattern!r} must be relative and stay inside the tree")
            if not pattern.startswith("k3_model/"):
                raise ValueError(f"allowed_paths entry {pattern!r} must lie under k3_model/")
        for field in ("requests_axis", "rows_axis", "draft_axis", "query_len_axis"):
            ax = getattr(self.scope, field)
            if ax is not None and ax not in axes:
                raise ValueError(f"scope.{field} {ax!r} is not in [axes]")
        for w in self.correctness.workloads:
            if w.phase not in self.scope.phases:
                raise ValueError(f"correctness workload {w.name!r} has phase {w.phase!r}, not in scope.phases "
                                 f"{list(self.scope.phases)}; set its phase = ... to one of them")
            if set(w.axes) >= {a for a in (self.scope.batch_axis, self.scope.draft_axis, self.scope.query_len_axis) if a}:
                ph, req, q, _rows = self.scope.step(w.axes, w.phase)
                if ph != w.phase:
                    raise ValueError(f"correctness workload {w.name!r} has phase {w.phase!r} but query length {q} makes it "
                                     f"a {ph!r} step; drop its phase (it follows the query length) or fix it")
                if not (self.scope.requests_min <= req <= self.scope.requests_max
                        and self.scope.query_len_min <= q <= self.scope.query_len_max):
                    raise ValueError(f"correctness workload {w.name!r} is a step of {req} requests at query length {q}, "
                                     f"outside the scope's requests [{self.scope.requests_min}, {self.scope.requests_max}] "
                                     f"and query length [{self.scope.query_len_min}, {self.scope.query_len_max}]")
        if self.scope.dtype_input not in self.inputs:
            raise ValueError(f"scope.dtype_input {self.scope.dtype_input!r} is not an input")
        names = [w.name for w in self.correctness.workloads]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"correctness.workloads: name {dupes[0]!r} appears twice; names must be unique")
        for w in self.correctness.workloads:
            if set(w.axes) != axes:
                raise ValueError(
                    f"correctness workload {w.name!r} sets axes {sorted(w.axes)}; expected exactly {sorted(axes)}"
                )
            for k, v in w.axes.items():
                if v < 1:
                    raise ValueError(f"correctness workload {w.name!r}: axis {k} = {v}; axes must be >= 1")
        if (self.domain is None and not any(w.random_template for w in self.correctness.workloads)
                and self.correctness.random_draws):
            raise ValueError(
                "correctness.random_draws > 0 but the task has no [domain] and no workload has random_template = "
                "true; declare the domain or mark the workloads random draws may start from"
            )
        if self.domain is not None:
            self._check_domain(self.domain)
        else:
            inv = next((w for w in self.correctness.workloads if w.invariance), None)
            if inv is not None:
                raise ValueError(f"correctness workload {inv.name!r} names invariance {inv.invariance!r}, but the task "
                                 "has no [domain] (invariances are declared in [domain.invariances])")
        missing_tol = sorted(set(self.outputs) - set(self.correctness.tolerance))
        if missing_tol:
            raise ValueError(f"correctness.tolerance has no entry for output {missing_tol[0]!r}")
        for p in self.perf.workloads:
            if p not in names:
                raise ValueError(
                    f"perf.workloads names {p!r}, which is not a correctness workload; every perf shape "
                    f"must also be a correctness shape (known: {', '.join(names)})"
                )
        return self

    def _check_domain(self, dom: DomainSpec) -> None:
        """The domain covers exactly this task's axes, params and inputs, stays in scope, and holds every
        fixed workload (legal values, legal constraints; cost constraints need not hold)."""
        axes = set(self.axes)
        if set(dom.axes) != axes:
            extra, missing = sorted(set(dom.axes) - axes), sorted(axes - set(dom.axes))
            raise ValueError(f"domain.axes must declare exactly the task's axes {sorted(axes)}; "
                             + (f"missing {missing}" if missing else f"not an axis: {extra}"))
        used = {k for w in self.correctness.workloads for k in w.params}
        if set(dom.params) != used:
            extra, missing = sorted(set(dom.params) - used), sorted(used - set(dom.params))
            raise ValueError(f"domain.params must declare exactly the params the workloads set {sorted(used)}; "
                             + (f"missing {missing}" if missing else f"set by no workload: {extra}"))
        clash = sorted(set(dom.params) & axes)
        if clash:
            raise ValueError(f"domain.params {clash[0]!r} is also an axis name; names must be distinct")
        if set(dom.inputs) != set(self.inputs):
            missing, extra = sorted(set(self.inputs) - set(dom.inputs)), sorted(set(dom.inputs) - set(self.inputs))
            raise ValueError(f"domain.inputs must describe exactly the task's inputs {sorted(self.inputs)}; "
                             + (f"missing {missing}" if missing else f"not an input: {extra}"))
        known = dom.names()
        for kind, exprs in (("constraints", dom.constraints), ("cost_constraints", dom.cost_constraints),
                            ("cost_ceiling", dom.cost_ceiling),
                            *((f"regimes.{n}.requires", (r.requires,)) for n, r in dom.regimes.items() if r.requires),
                            *((f"overlays.{n}.requires", (o.requires,)) for n, o in dom.overlays.items() if o.requires),
                            *((f"invariances.{n}.requires", (v.requires,)) for n, v in dom.invariances.items()
                              if v.requires)):
            for c in exprs:
                unknown = sorted(check_constraint(c) - known)
                if unknown:
                    raise ValueError(f"domain.{kind}: {c!r} names {unknown[0]!r}, which is neither an axis nor a "
                                     f"declared param (known: {', '.join(sorted(known))})")
        sc = self.scope
        for ax, off, lo_s, hi_s, what in ((sc.requests_axis, 0, sc.requests_min, sc.requests_max, "requests"),
                                          (sc.rows_axis, 0, 1, sc.requests_max * sc.query_len_max, "token rows"),
                                          (sc.draft_axis, 1, sc.query_len_min, sc.query_len_max, "query length"),
                                          (sc.query_len_axis, 0, sc.query_len_min, sc.query_len_max, "query length")):
            if ax is None:
                continue
            b = dom.axes[ax]
            lo, hi = (min(b.choices), max(b.choices)) if b.choices is not None else (b.min, b.max)
            if lo + off < lo_s or hi + off > hi_s:  # type: ignore[operator]
                raise ValueError(f"domain.axes.{ax} allows [{lo}, {hi}], so {what} [{lo + off}, {hi + off}], outside the "
                                 f"scope's {what} range [{lo_s}, {hi_s}]")
        if self.distributed is not None:
            wax = dom.axes[self.distributed.world_size_axis]
            sizes = wax.choices if wax.choices is not None else range(int(wax.min), int(wax.max) + 1)  # type: ignore[arg-type]
            outside = sorted(set(sizes) - set(self.scope.tp_sizes))
            if outside:
                raise ValueError(f"domain.axes.{self.distributed.world_size_axis} allows world sizes {outside}, "
                                 f"outside scope.tp_sizes {list(self.scope.tp_sizes)}")
        for w in self.correctness.workloads:
            for k, v in w.axes.items():
                if not dom.axes[k].contains(v):
                    raise ValueError(f"correctness workload {w.name!r}: axis {k} = {v} is outside domain.axes.{k}; "
                                     "the domain must hold every fixed workload")
            for k, v in w.params.items():
                if not dom.params[k].contains(v):
                    raise ValueError(f"correctness workload {w.name!r}: param {k} = {v!r} is outside "
                                     f"domain.params.{k}; the domain must hold every fixed workload")
            values = {**w.axes, **w.params}
            try:
                _, overlays = dom.split_case(w.case)
            except ValueError as exc:
                raise ValueError(f"correctness workload {w.name!r}: {exc}") from exc
            for o in overlays:
                req = dom.overlays[dom.overlay_of(o)[0]].requires
                if req and not eval_constraint(req, values):
                    raise ValueError(f"correctness workload {w.name!r}: overlay {o!r} requires {req!r}, which the "
                                     "workload does not meet")
            if w.invariance:
                inv = dom.invariances.get(w.invariance)
                if inv is None or not inv.checked:
                    known = sorted(n for n, v in dom.invariances.items() if v.checked)
                    raise ValueError(f"correctness workload {w.name!r}: invariance {w.invariance!r} is not a checked "
                                     f"[domain.invariances] entry (with transform and relation); known: "
                                     f"{', '.join(known) or 'none'}")
                if inv.requires and not eval_constraint(inv.requires, values):
                    raise ValueError(f"correctness workload {w.name!r}: invariance {w.invariance!r} requires "
                                     f"{inv.requires!r}, which the workload does not meet")
                if inv.regimes and dom.split_case(w.case)[0] not in inv.regimes:
                    raise ValueError(f"correctness workload {w.name!r}: invariance {w.invariance!r} applies to regimes "
                                     f"{list(inv.regimes)}, not to case {w.case!r}")
            for c in dom.constraints:
                if not eval_constraint(c, values):
                    raise ValueError(f"correctness workload {w.name!r} violates domain constraint {c!r}; the "
                                     "contract's constraints must hold for every fixed workload")

    def world_size(self, w: WorkloadSpec) -> int:
        """The TP world size of workload ``w`` (1 for tasks without a [distributed] table)."""
        return 1 if self.distributed is None else int(w.axes[self.distributed.world_size_axis])

    def workload(self, name: str) -> WorkloadSpec:
        """The correctness workload called ``name``.

        Raises:
            KeyError: no such workload.
        """
        for w in self.correctness.workloads:
            if w.name == name:
                return w
        raise KeyError(f"task {self.task_id!r} has no workload {name!r}")

    @property
    def all_forbidden(self) -> tuple[str, ...]:
        """The always-forbidden globs (see :data:`ALWAYS_FORBIDDEN`)."""
        return ALWAYS_FORBIDDEN


def _format_validation(task_id: str, path: Path, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        got = err.get("input")
        got_s = repr(got) if not isinstance(got, dict) else "a table with keys " + ", ".join(map(str, got))
        if len(got_s) > 120:
            got_s = got_s[:117] + "..."
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field (not part of the task schema; check the spelling or remove it)"
        elif err["type"] == "missing":
            msg = "required field is missing"
            got_s = "nothing"
        lines.append(f"Task {task_id!r} ({path}): field '{loc}': {msg}; got {got_s}.")
    return "\n".join(lines)


def load_task_file(path: Path) -> TaskSpec:
    """Load and validate one ``task.toml``; the task id is its folder's name.

    Raises:
        TaskSpecError: the file is missing, is not valid TOML (duplicate keys included), or does not
            match the schema; the message names the file, the field, expected and got.
    """
    path = Path(path)
    task_id = path.parent.name
    if not path.is_file():
        raise TaskSpecError(
            f"Task {task_id!r}: spec file {path} does not exist; every task folder needs a task.toml."
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise TaskSpecError(f"Task {task_id!r} ({path}): not valid TOML: {exc}. Fix the syntax.") from None
    for reserved in ("task_id", "root"):
        if reserved in data:
            raise TaskSpecError(
                f"Task {task_id!r} ({path}): field '{reserved}' is set by the loader (the folder name "
                f"is the task id); remove it from the file."
            )
    if not re.fullmatch(r"[a-z][a-z0-9_]*", task_id):
        raise TaskSpecError(
            f"Task folder {path.parent}: name {task_id!r} is not a valid task id; expected lowercase "
            "letters, digits and underscores, starting with a letter."
        )
    try:
        spec = TaskSpec.model_validate({**data, "task_id": task_id, "root": path.parent.resolve()})
    except ValidationError as exc:
        raise TaskSpecError(_format_validation(task_id, path, exc)) from None
    for fname in ("reference.py", "inputs.py"):
        if not (path.parent / fname).is_file():
            raise TaskSpecError(
                f"Task {task_id!r} ({path.parent}): {fname} is missing; a task folder holds task.toml, "
                "reference.py and inputs.py."
            )
    return spec


def tasks_dir(repo_root: Path) -> Path:
    """``<repo_root>/tasks``."""
    return Path(repo_root) / "tasks"


def list_task_ids(repo_root: Path) -> list[str]:
    """Ids of every folder under ``tasks/`` that holds a ``task.toml`` (plain discovery, no registry)."""
    d = tasks_dir(repo_root)
    return sorted(p.parent.name for p in d.glob("*/task.toml"))


def load_task(repo_root: Path, task_id: str) -> TaskSpec:
    """Load ``tasks/<task_id>/task.toml`` under ``repo_root``.

    Raises:
        TaskSpecError: unknown task id (the message lists the known ones) or an invalid spec.
    """
    path = tasks_dir(repo_root) / task_id / "task.toml"
    if not path.is_file():
        known = ", ".join(list_task_ids(repo_root)) or "none"
        raise TaskSpecError(
            f"Task {task_id!r}: no {path.relative_to(repo_root) if path.is_relative_to(repo_root) else path}; "
            f"known tasks: {known}. Check the id or add the task folder."
        )
    return load_task_file(path)


def check_target(repo_root: Path, spec: TaskSpec) -> None:
    """Check, without importing anything, that ``spec.target`` (``module:function``) names a module file of
    the checkout that defines that function at its top level (a ``def``, or a name bound by assignment
    or import). Otherwise every candidate's correctness run would fail on the task's own mistake.

    Raises:
        TaskSpecError: the module file is missing or does not parse, or it does not define the function;
            the message names the task.toml, the target and what the module defines.
    """
    module, func = spec.target.split(":")
    where = f"Task {spec.task_id!r} ({Path(spec.root) / 'task.toml'})"
    base = Path(repo_root).joinpath(*module.split("."))
    src = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
    if src is None:
        raise TaskSpecError(f"{where}: target {spec.target!r} names module {module}, but neither "
                            f"{base.with_suffix('.py').relative_to(repo_root)} nor "
                            f"{(base / '__init__.py').relative_to(repo_root)} exists; fix 'target'.")
    try:
        tree = ast.parse(src.read_text(encoding="utf-8"), filename=str(src))
    except SyntaxError as exc:
        raise TaskSpecError(f"{where}: target module {src.relative_to(repo_root)} does not parse: {exc}.") from None
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    if func not in names:
        defined = sorted(n for n in names if not n.startswith("_") and n.islower())
        raise TaskSpecError(f"{where}: target {spec.target!r}: {src.relative_to(repo_root)} defines no top-level "
                            f"{func!r}; it defines {', '.join(defined[:12]) or 'nothing public'}. Fix 'target'.")


def load_any(path_or_id: str, repo_root: Path) -> TaskSpec:
    """Load a task by id, by folder or by ``task.toml`` path."""
    p = Path(path_or_id)
    if p.suffix == ".toml":
        return load_task_file(p)
    if p.is_dir() and (p / "task.toml").is_file():
        return load_task_file(p / "task.toml")
    return load_task(repo_root, path_or_id)


def model_dump_spec(spec: TaskSpec) -> dict[str, Any]:
    """JSON-ready dump of a spec (paths as strings) for result files."""
    return spec.model_dump(mode="json")
