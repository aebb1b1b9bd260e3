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
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping

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
        phase: decode, prefill or mixed (what the dispatcher is told).
        random_template: random correctness draws may start from this workload and redraw the batch axis.
    """

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_\-]*$")
    axes: dict[str, int]
    params: dict[str, bool | int | float | str] = Field(default_factory=dict)
    case: str = "realistic"
    phase: Literal["decode", "prefill", "mixed"] = "decode"
    random_template: bool = False
    note: str = ""


class ScopeSpec(_Frozen):
    """Where a latency-specialized implementation may claim to run (DESIGN.md "K3 ops").

    Attributes:
        devices: device kinds (``cpu``, ``cuda``).
        phases: batch phases (decode only for this project's kernels).
        tp_sizes: tensor-parallel world sizes.
        dtypes: dtypes of ``dtype_input``.
        dtype_input: the input whose dtype is the op's dtype.
        batch_axis: the axis that is the decode batch.
        batch_min, batch_max: inclusive batch range (requests).
    """

    devices: tuple[Literal["cpu", "cuda"], ...]
    phases: tuple[Literal["decode", "prefill", "mixed"], ...] = ("decode",)
    tp_sizes: tuple[int, ...] = (1,)
    dtypes: tuple[Literal["float32", "float16", "bfloat16"], ...]
    dtype_input: str
    batch_axis: str
    batch_min: int = Field(ge=1)
    batch_max: int = Field(ge=1)

    @model_validator(mode="after")
    def _range(self) -> "ScopeSpec":
        if self.batch_max < self.batch_min:
            raise ValueError(f"batch_max ({self.batch_max}) is below batch_min ({self.batch_min})")
        return self


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
    def _devices_reason(self) -> "PerfSpec":
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

    @model_validator(mode="after")
    def _consistent(self) -> "TaskSpec":
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
        if self.scope.batch_axis not in axes:
            raise ValueError(f"scope.batch_axis {self.scope.batch_axis!r} is not in [axes]")
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
        if not any(w.random_template for w in self.correctness.workloads) and self.correctness.random_draws:
            raise ValueError(
                "correctness.random_draws > 0 but no workload has random_template = true; mark the "
                "workloads random draws may start from"
            )
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
