"""Judge one candidate's correctness (isolation, correctness, activation) under several run-time seeds.

Each seed draws other random domain configurations (``guards.cases.domain_draws``), so a sweep of seeds
reaches more of the op's legal input domain than one verdict does. Writes one JSON file: per seed the
verdict lines, the failing configurations and the shrunk one, with the environment.

Usage: ``python bench/correctness_seeds.py TASK CANDIDATE --device cuda --seeds 12 --seeds 13 --out FILE``
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from the repo root

app = typer.Typer(add_completion=False)


@app.command()
def main(task_id: str, candidate: str, device: str = typer.Option("cuda"),
         seeds: list[int] = typer.Option(..., "--seeds"), out: Path = typer.Option(..., "--out")) -> None:
    """Judge ``candidate`` for ``task_id`` once per seed (no model eval, no perf) and write ``out``."""
    from guards.activation import ActivationGuard
    from guards.correctness import CorrectnessGuard
    from guards.isolation import IsolationGuard
    from workbench import env as envmod
    from workbench.pipeline import judge_candidate
    from workbench.taskspec import load_task
    from workbench.worktree import create_candidate

    root = Path.cwd()
    task = load_task(root, task_id)
    runs = []
    for seed in seeds:
        t0 = time.monotonic()
        cand = create_candidate(root, task_id, candidate)
        result, path = judge_candidate(root, task, cand, device=device, seed=seed,
                                       guards=[IsolationGuard(), CorrectnessGuard(), ActivationGuard()])
        bad = [c for c in result.cases if not c.passed]
        runs.append({"seed": seed, "accepted": result.accepted, "seconds": round(time.monotonic() - t0, 1),
                     "verdicts": [v.one_line() for v in result.verdicts], "cases": len(result.cases),
                     "failing": [{"name": c.name, "axes": c.axes, "params": c.params, "case": c.case,
                                  "first": c.mismatches[0] if c.mismatches else ""} for c in bad],
                     "result_file": path.name})
        print(f"seed {seed}: {'ACCEPTED' if result.accepted else 'REJECTED'} ({len(bad)} of {len(result.cases)} "
              f"configurations wrong) in {runs[-1]['seconds']} s", flush=True)
    out.write_text(json.dumps({"task": task_id, "candidate": candidate, "device": device, "runs": runs,
                               "environment": envmod.collect(device)}, indent=1, default=str))


if __name__ == "__main__":
    app()
