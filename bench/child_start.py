"""How long a guard child takes from start to answer, exec'd afresh or forked from the fork server.

One request per run: a correctness request with no cases for the MoE task (the child imports torch and the
worktree's ``k3_model``, arms its hooks, loads the candidate's target and answers), run through
``guards.sandbox.run_child`` exactly as the guards do, with ``WORKBENCH_CHILD_START`` set to each form in turn:

- ``exec``: ``python -I guards/_child_main.py`` (under ``setpriv`` as root), imports everything itself;
- ``fork``: forked from this process's fork server (``guards/_zygote.py``), which imported torch once; the
  server's own start (its first child) is reported apart.

    python bench/child_start.py OUT.json [--repeats 7]

Writes ``OUT`` (JSON, with the environment): each run's wall time from ``run_child`` call to outcome (seconds),
per form the median, and the fork server's first child.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from guards import sandbox  # noqa: E402
from workbench import env as envmod  # noqa: E402
from workbench import envs  # noqa: E402

REQUEST = {"mode": "correctness", "target": "k3_model.ops.moe_dispatch:moe_route_dispatch", "op": "moe_dispatch",
           "device": "cpu", "decode_backend": "latency_specialized", "cases": []}


def one() -> float:
    t0 = time.perf_counter()
    out = sandbox.run_child(ROOT, REQUEST, timeout_s=120, memory_bytes=8 * 2**30, device="cpu")
    if out.problem is not None or not (out.response or {}).get("ok"):
        raise SystemExit(f"child failed: {out.problem or out.response}")
    return round(time.perf_counter() - t0, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    runs: dict[str, list[float]] = {}
    first_fork = None
    for form in ("exec", "fork"):
        os.environ[envs.CHILD_START.name] = form
        if form == "fork":
            sandbox.close_zygotes()
            first_fork = one()  # includes the fork server's start (its imports)
        runs[form] = [one() for _ in range(args.repeats)]
    out = {"bench": "child_start", "repeats": args.repeats, "runs_s": runs,
           "median_s": {f: statistics.median(r) for f, r in runs.items()},
           "fork_first_child_s": first_fork, "uid_drop": sandbox.drop_privileges_available(),
           "environment": envmod.collect("cpu")}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("median_s", "fork_first_child_s")}))


if __name__ == "__main__":
    main()
