"""How long one judgment takes, per revision of the workbench's code and per heap setting of the judging
process (workbench/heap.py): the judge's own costs (hashing, copies, page faults), not the candidate's.

Each revision is checked out in a temporary worktree and imported from there (its guards and its child);
each judgment runs in its own process, on one fresh clone of this repository (the judged base), the
revisions and settings interleaved so a drift of the machine hits all of them. A revision without
``workbench/heap.py`` is judged with glibc's default allocator only.

Records wall time, user and system CPU time and minor page faults of the judgment's process tree (the
judge and its children, ``getrusage(RUSAGE_CHILDREN)``) in a JSON file with the environment.

Usage: ``python bench/judge_speed.py --revs 5dcecc5 HEAD --out bench/results/cpu/judge_speed_session18.json``
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
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "default":
    try:
        import workbench.heap
        workbench.heap.keep_freed_memory = lambda: False
    except ImportError:
        pass
import guards.correctness, workbench.pipeline
for mod in (guards.correctness, workbench.pipeline):
    assert Path(mod.__file__).is_relative_to(sys.argv[1]), mod.__file__
result, _ = workbench.pipeline.run_candidate(Path(sys.argv[3]), sys.argv[4], sys.argv[5], device="cpu",
                                             seed=int(sys.argv[6]))
print(result.acceptance_label, result.first_failure().guard if result.first_failure() else "-")
"""


def judge(code: Path, heap: str, clone: Path, task: str, fixture: str) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", JUDGE, str(code), heap, str(clone), task, fixture, str(SEED)],
                       cwd=clone, capture_output=True, text=True, timeout=1200)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"judging {fixture} ({code.name}, {heap}) failed:\n{p.stderr[-3000:]}")
    return {"task": task, "fixture": fixture, "heap": heap, "outcome": p.stdout.strip().splitlines()[-1],
            "wall_s": round(wall, 2), "user_s": round(after.ru_utime - before.ru_utime, 2),
            "sys_s": round(after.ru_stime - before.ru_stime, 2), "minor_faults": after.ru_minflt - before.ru_minflt}


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--revs", nargs="+", required=True, help="revisions of the workbench's code to compare")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    from workbench import env as envmod

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "judged"
        subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
        codes = []
        for rev in args.revs:
            sha = git("rev-parse", rev)
            code = Path(tmp) / f"code-{sha[:10]}"
            git("worktree", "add", "-q", "--detach", str(code), sha)
            heaps = ("default", "keep") if (code / "workbench/heap.py").is_file() else ("default",)
            codes += [(sha, code, heap) for heap in heaps]
        try:
            for task, fixture in FIXTURES:
                for _ in range(args.repeat):
                    for sha, code, heap in codes:
                        rows.append({"rev": sha, **judge(code, heap, clone, task, fixture)})
                        print(json.dumps(rows[-1]), flush=True)
        finally:
            for _, code, _ in codes:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(code)], check=False)
    args.out.write_text(json.dumps({"bench": "judge_speed", "revs": args.revs, "seed": SEED,
                                    "environment": envmod.collect("cpu"), "rows": rows}, indent=1) + "\n")
    print(args.out)


if __name__ == "__main__":
    main()
