"""The judging process's heap setting (workbench/heap.py): one judgment with the default glibc allocator and
one with :func:`workbench.heap.keep_freed_memory`, per fixture, each in its own process on a fresh clone.

Records wall time, user and system CPU time and minor page faults of the judgment's process tree (the judge
and its children, ``getrusage(RUSAGE_CHILDREN)``) in a JSON file with the environment.

Usage: ``python bench/judge_heap.py --out bench/results/cpu/judge_heap_session18.json [--repeat 2]``
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = (
    ("k3_small_m_gemm", "tasks/k3_small_m_gemm/fixtures/bad/correctness-drops-the-n-tail.inject.toml"),
    ("k3_dspark_verify", "tasks/k3_dspark_verify/fixtures/bad/correctness-position-not-vocab-id.inject.toml"),
)
SEED = 5
JUDGE = """
import sys
from pathlib import Path
import workbench.heap
if sys.argv[1] == "default":
    workbench.heap.keep_freed_memory = lambda: False
from workbench.pipeline import run_candidate
result, _ = run_candidate(Path(sys.argv[2]), sys.argv[3], sys.argv[4], device="cpu", seed=int(sys.argv[5]))
print(result.acceptance_label, result.first_failure().guard if result.first_failure() else "-")
"""


def judge(clone: Path, mode: str, task: str, fixture: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", JUDGE, mode, str(clone), task, fixture, str(SEED)], cwd=clone,
                       capture_output=True, text=True, timeout=1200)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"judging {fixture} ({mode}) failed:\n{p.stderr[-3000:]}")
    return {"task": task, "fixture": fixture, "heap": mode, "outcome": p.stdout.strip().splitlines()[-1],
            "wall_s": round(wall, 2), "user_s": round(after.ru_utime - before.ru_utime, 2),
            "sys_s": round(after.ru_stime - before.ru_stime, 2), "minor_faults": after.ru_minflt - before.ru_minflt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    from workbench import env as envmod

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "repo"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        for task, fixture in FIXTURES:
            for _ in range(args.repeat):
                for mode in ("default", "keep"):  # interleaved: a drift of the machine hits both
                    rows.append(judge(clone, mode, task, fixture))
                    print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    args.out.write_text(json.dumps({"bench": "judge_heap", "commit": commit, "seed": SEED,
                                    "environment": envmod.collect("cpu"), "rows": rows}, indent=1) + "\n")
    print(args.out)


if __name__ == "__main__":
    main()
