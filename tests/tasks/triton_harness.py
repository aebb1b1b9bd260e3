"""What the Triton fixture tests share: loading a kernel file and the task's inputs and reference by path,
the task's tolerances, and a script run in a child under Triton's CPU interpreter (``TRITON_INTERPRET=1``
must be set before triton is imported, so the interpreted runs live in a child process)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def load_module(name: str, path: Path):
    """Import the file ``path`` as a module named ``name`` (not registered in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def task_tolerances(task_id: str) -> dict[str, dict[str, float]]:
    """``output -> {"rtol", "atol"}`` from the task's ``[correctness.tolerance]`` (task.toml)."""
    from workbench.taskspec import load_task

    tol = load_task(ROOT, task_id).correctness.tolerance
    return {k: {"rtol": v.rtol, "atol": v.atol} for k, v in tol.items()}


def run_interpreted(tmp_path: Path, script: str, kernel: Path, task_id: str, cases: list) -> list[dict]:
    """Run ``script`` under the interpreter with the arguments KERNEL INPUTS.py REFERENCE.py CASES-JSON
    TOLERANCES-JSON; its last stdout line is a JSON list, one entry per case (asserted)."""
    pytest.importorskip("triton")
    task_dir = ROOT / "tasks" / task_id
    path = tmp_path / "run.py"
    path.write_text(script)
    out = subprocess.run([sys.executable, str(path), str(kernel), str(task_dir / "inputs.py"),
                          str(task_dir / "reference.py"), json.dumps(cases), json.dumps(task_tolerances(task_id))],
                         capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report) == len(cases)
    return report


def cuda_modules(prefix: str, kernel: Path, task_id: str):
    """The kernel module, the task's inputs and its reference, loaded for a CUDA test (skips without CUDA or triton)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    task_dir = ROOT / "tasks" / task_id
    return (load_module(f"{prefix}_kernel", kernel), load_module(f"{prefix}_inp", task_dir / "inputs.py"),
            load_module(f"{prefix}_ref", task_dir / "reference.py"))
