"""Turn a task's workloads into concrete cases (inputs, output specs, op arguments).

Task modules (``reference.py``, ``inputs.py``) are loaded from the workbench's own checkout, by file
path: tasks are folders, not packages, and adding one needs no code change here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from workbench.errors import TaskSpecError
from workbench.taskspec import TaskSpec, WorkloadSpec, eval_dim

INT_POISON = -7777
"""Value written into integer outputs before each call (never a valid id, index or count)."""


def load_task_module(task: TaskSpec, name: str) -> ModuleType:
    """Import ``tasks/<id>/<name>.py`` under a private module name.

    Raises:
        TaskSpecError: the file is missing or raises on import.
    """
    path = Path(task.root) / f"{name}.py"
    mod_name = f"_wb_task_{task.task_id}_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise TaskSpecError(f"Task {task.task_id!r}: {path} cannot be loaded; it must be a Python file.")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    except Exception as exc:
        raise TaskSpecError(f"Task {task.task_id!r}: importing {path} failed: {type(exc).__name__}: {exc}") from exc
    sys.modules[mod_name] = mod
    return mod


@dataclasses.dataclass
class Case:
    """One concrete configuration with its inputs.

    Attributes:
        workload: the workload it came from (for random draws: a copy with the batch redrawn).
        inputs_a: inputs for the first and third call.
        inputs_b: other inputs of the same shapes for the second call (buffers reused).
        kwargs: scalar op arguments (params + axis_params).
        output_specs: name -> {shape, dtype, poison}.
    """

    workload: WorkloadSpec
    inputs_a: dict[str, Any]
    inputs_b: dict[str, Any]
    kwargs: dict[str, Any]
    output_specs: dict[str, dict[str, Any]]

    world_size: int = 1
    per_rank: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.workload.name

    def request_entry(self, rank: int = 0) -> dict[str, Any]:
        """The form the child of TP rank ``rank`` reads (per-rank inputs sliced to that rank's tensor)."""
        return {
            "name": self.name,
            "phase": self.workload.phase,
            "kwargs": self.kwargs,
            "inputs_a": rank_inputs(self.inputs_a, self.per_rank, rank),
            "inputs_b": rank_inputs(self.inputs_b, self.per_rank, rank),
            "outputs": self.output_specs,
            "world_size": self.world_size,
        }


def rank_inputs(inputs: dict[str, Any], per_rank: tuple[str, ...], rank: int) -> dict[str, Any]:
    """The inputs one TP rank sees: ``per_rank`` tensors (stacked ``[W, ...]``) sliced to ``[rank]``.

    The slices are contiguous copies, so ranks never share storage.
    """
    return {k: (v[rank].clone().contiguous() if k in per_rank else v) for k, v in inputs.items()}


def _derive_seed(seed: int, *parts: str) -> int:
    h = hashlib.sha256(("|".join([str(seed), *parts])).encode()).digest()
    return int.from_bytes(h[:4], "little")


def op_kwargs(task: TaskSpec, w: WorkloadSpec) -> dict[str, Any]:
    """Scalar keyword arguments of the op for workload ``w``."""
    return {**w.params, **{kw: w.axes[ax] for kw, ax in task.axis_params.items()}}


def output_specs(task: TaskSpec, axes: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Concrete shapes, dtypes and poison values of the outputs."""
    specs = {}
    for name, t in task.outputs.items():
        poison = t.poison
        if poison is None:
            poison = float("nan") if t.dtype.startswith(("float", "bfloat")) else (True if t.dtype == "bool" else INT_POISON)
        specs[name] = {"shape": [eval_dim(d, axes) for d in t.shape], "dtype": t.dtype, "poison": poison,
                       "inplace": t.inplace}
    return specs


def random_workloads(task: TaskSpec, seed: int) -> list[WorkloadSpec]:
    """``correctness.random_draws`` workloads drawn at run time inside the declared scope.

    Each starts from a ``random_template`` workload and redraws the batch axis uniformly in
    ``[scope.batch_min, scope.batch_max]``.
    """
    rng = random.Random(_derive_seed(seed, "random_workloads"))
    templates = [w for w in task.correctness.workloads if w.random_template]
    out = []
    for i in range(task.correctness.random_draws):
        t = rng.choice(templates)
        axes = dict(t.axes)
        axes[task.scope.batch_axis] = rng.randint(task.scope.batch_min, task.scope.batch_max)
        out.append(t.model_copy(update={"name": f"random-{i}-{t.name}", "axes": axes, "random_template": False}))
    return out


def build_case(task: TaskSpec, w: WorkloadSpec, seed: int) -> Case:
    """Inputs (two independent draws) and output specs for one workload.

    Raises:
        TaskSpecError: ``make_inputs`` fails or returns tensors that do not match the task's inputs.
    """
    import torch

    inputs_mod = load_task_module(task, "inputs")
    draws = []
    for part in ("a", "b"):
        s = _derive_seed(seed, w.name, part, repr(sorted(w.axes.items())))
        try:
            inp = inputs_mod.make_inputs(dict(w.axes), s, w.case)
        except Exception as exc:
            raise TaskSpecError(
                f"Task {task.task_id!r}: inputs.make_inputs failed for workload {w.name!r} "
                f"(case {w.case!r}): {type(exc).__name__}: {exc}"
            ) from exc
        for name, spec in task.inputs.items():
            t = inp.get(name)
            shape = tuple(eval_dim(d, w.axes) for d in spec.shape)
            if spec.per_rank:
                shape = (task.world_size(w), *shape)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != getattr(torch, spec.dtype):
                got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise TaskSpecError(
                    f"Task {task.task_id!r}: make_inputs for workload {w.name!r} returned input {name!r} as "
                    f"{got}; expected {shape} {spec.dtype}."
                )
        draws.append({k: inp[k].contiguous() for k in task.inputs})
    per_rank = tuple(k for k, spec in task.inputs.items() if spec.per_rank)
    return Case(w, draws[0], draws[1], op_kwargs(task, w), output_specs(task, w.axes),
                world_size=task.world_size(w), per_rank=per_rank)


def perf_rotation(task: TaskSpec, w: WorkloadSpec, seed: int, n: int) -> list[dict[str, Any]]:
    """``n`` independent input draws for one perf workload, one per timed or warm-up call.

    Different data in different buffers on every call: a cache keyed by pointer, shape or content
    never hits while timed, and the parent can check the outputs of any timed call.

    Raises:
        TaskSpecError: ``make_inputs`` fails for the workload.
    """
    inputs_mod = load_task_module(task, "inputs")
    out = []
    for j in range(n):
        s = _derive_seed(seed, w.name, "perf", str(j))
        try:
            inp = inputs_mod.make_inputs(dict(w.axes), s, w.case)
        except Exception as exc:
            raise TaskSpecError(
                f"Task {task.task_id!r}: inputs.make_inputs failed for perf workload {w.name!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        out.append({k: inp[k].contiguous() for k in task.inputs})
    return out


def correctness_cases(task: TaskSpec, seed: int) -> list[Case]:
    """The fixed workloads plus the run-time random draws, with inputs."""
    ws = list(task.correctness.workloads) + random_workloads(task, seed)
    return [build_case(task, w, seed) for w in ws]
