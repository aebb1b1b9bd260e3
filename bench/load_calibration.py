"""False rejections under machine load: judge honest candidates while planted CPU hogs run.

Every guard of a ``workbench run`` judges each candidate ``--runs`` times on a scratch clone of this
checkout (each judging with its own ledger, so the runs are independent and not pooled), while
``--hogs`` processes spin on the CPU. A rejection of an honest candidate is a false rejection; the
target is none (issue 20 item 2). Writes one JSON file: per run the verdict lines, the perf rows
(speedup, interval, extension rounds, load average), and the environment.

Usage: ``python bench/load_calibration.py --case k3_moe_dispatch:good/lean-torch-cpu --runs 3 --hogs 1
--out bench/results/cpu/load_calibration.json``
"""

from __future__ import annotations

import json
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from the repo root

app = typer.Typer(add_completion=False)


def _spin(stop_at: float) -> None:
    """A CPU hog: arithmetic until ``stop_at`` (``time.time()`` seconds)."""
    x = 0
    while time.time() < stop_at:
        for _ in range(100_000):
            x = (x * 31 + 7) % 1_000_003


@app.command()
def main(case: list[str] = typer.Option(..., "--case", help="TASK:FIXTURE, e.g. k3_moe_dispatch:good/lean-torch-cpu "
                                        "(repeatable)."),
         runs: int = typer.Option(3, help="Judgings per case."),
         hogs: int = typer.Option(1, help="CPU-spinning processes running during every judging."),
         out: Path = typer.Option(..., "--out")) -> None:
    """Judge each honest ``case`` ``runs`` times under ``hogs`` CPU hogs and write ``out``."""
    import git

    from workbench import env as envmod
    from workbench import envs
    from workbench.pipeline import run_candidate

    root = Path.cwd()
    started = time.time()
    rows = []
    with tempfile.TemporaryDirectory(prefix="wb-load-cal-") as tmp:
        clone = Path(tmp) / "repo"
        git.Repo(root).clone(str(clone))
        procs = [multiprocessing.Process(target=_spin, args=(time.time() + 6 * 3600,), daemon=True)
                 for _ in range(hogs)]
        for p in procs:
            p.start()
        try:
            for spec in case:
                task_id, fixture = spec.split(":", 1)
                src = clone / "tasks" / task_id / "fixtures" / fixture
                for i in range(runs):
                    envs.JUDGINGS.export(Path(tmp) / f"ledger-{task_id}-{i}.jsonl")  # independent: not pooled
                    t0 = time.monotonic()
                    result, path = run_candidate(clone, task_id, str(src), device="cpu")
                    first = result.first_failure()
                    rows.append({
                        "case": spec, "run": i, "seed": result.seed, "accepted": result.accepted,
                        "seconds": round(time.monotonic() - t0, 1),
                        "first_failure": first.one_line() if first else None,
                        "verdicts": [v.one_line() for v in result.verdicts],
                        "perf": [{"name": p.name, "speedup": round(p.speedup, 4),
                                  "ci": [round(x, 4) for x in p.speedup_ci], "verdict": p.verdict,
                                  "extension_rounds": p.extension_rounds, "load_avg": p.load_avg, "cpus": p.cpus}
                                 for p in result.perf]})
                    print(f"{spec} run {i}: {'ACCEPTED' if result.accepted else 'REJECTED'} "
                          f"({rows[-1]['seconds']} s){'' if result.accepted else ': ' + rows[-1]['first_failure']}",
                          flush=True)
        finally:
            for p in procs:
                p.terminate()
    false = [r for r in rows if not r["accepted"]]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "what": "honest candidates judged by every guard while CPU hogs run; a rejection is a false rejection",
        "command": "python bench/load_calibration.py " + " ".join(f"--case {c}" for c in case)
                   + f" --runs {runs} --hogs {hogs} --out {out}",
        "hogs": hogs, "runs_per_case": runs, "judgings": len(rows), "false_rejections": len(false),
        "wall_s": round(time.time() - started, 1), "environment": envmod.collect("cpu"), "runs": rows},
        indent=1) + "\n")
    print(f"{len(false)} false rejection(s) in {len(rows)} judgings -> {out}")


if __name__ == "__main__":
    app()
